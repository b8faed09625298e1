"""Qwen3-MoE's sparse block on the `vllm` backend against vLLM 0.26.0's own fused-MoE calls, bit for bit, and
its backward (torchtitan_compat/moe.py); then the whole model against vLLM's engine, logprobs and routes.

Shapes are Qwen3-30B-A3B's (D 2048, 128 experts of width 768, top-8). Every bitwise claim is torch.equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

T, D, E, I, K = 300, 2048, 128, 768, 8


@pytest.fixture(autouse=True, scope="module")
def _moe_extension():
    """Skipped, with the reason, where vLLM's fused-MoE extension is not installed (a vLLM build without it)."""
    try:
        import vllm._moe_C_stable_libtorch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"vLLM's fused-MoE extension is missing ({e}): install the complete vllm 0.26.0 wheel")


def rand(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


@pytest.fixture(scope="module")
def block():
    from torchtitan_compat.vllm_ops import VLLMBackend

    be = VLLMBackend(sampler="v1")
    x, wg = rand(T, D, seed=1), rand(E, D, scale=0.02, seed=2)
    w13, w2 = rand(E, 2 * I, D, scale=0.02, seed=3), rand(E, D, I, scale=0.02, seed=4)
    w, ids = be.moe_route(be.linear(x, wg), K, True)
    return be, x, wg, w13, w2, w, ids


def test_pinned_config_is_vllms():
    from torchtitan_compat.vllm_ops import BATCH_INVARIANT_MOE_CONFIG
    from vllm.model_executor.layers.fused_moe.fused_moe import get_default_config

    for m in (1, 5, 300, 8192):
        assert get_default_config(m, E, 2 * I, D, K, None) == BATCH_INVARIANT_MOE_CONFIG


def test_every_tuned_tile_gives_the_pinned_bits(block):
    """vLLM's tuned configs for this GPU and Qwen3-30B-A3B's experts (other BLOCK_M, BLOCK_N, BLOCK_K, warps, stages),
    each at its own token count and at 300 tokens: the sparse block's output and gate/up output are torch.equal to
    the pinned batch-invariant config's. This is what lets the engine and the trainer run the tuned tiles
    (vllm_ops.moe_config, vllm_patches patch 5)."""
    from torchtitan_compat.vllm_ops import BATCH_INVARIANT_MOE_CONFIG, tuned_moe_configs

    be, _, wg, w13, w2, _, _ = block
    table = tuned_moe_configs(E, I)
    if not table:
        pytest.skip(f"vLLM ships no tuned fused-MoE config for {torch.cuda.get_device_name()} at E={E}, N={I}")
    for m, cfg in sorted(table.items()):
        for t in sorted({m, 300}):
            x = rand(t, D, seed=10 + t)
            w, ids = be.moe_route(be.linear(x, wg), K, True)
            y0, c0 = be.moe_experts(x, w13, w2, w, ids, config=BATCH_INVARIANT_MOE_CONFIG)
            y, c1 = be.moe_experts(x, w13, w2, w, ids, config=cfg)
            assert torch.equal(y, y0) and torch.equal(c1, c0), (m, t, cfg)


def test_engine_picks_the_trainers_tile():
    """With the project's vLLM patches applied, vLLM's own config lookup in batch-invariant mode returns the tile
    the trainer's moe_config picks, at every token count (tuned table, nearest count); quantized lookups keep
    vLLM's answer."""
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    from spirl.numerics import vllm_patches
    from torchtitan_compat.vllm_ops import moe_config

    vllm_patches.apply()
    for m in (1, 3, 8, 100, 300, 1000, 4096, 20000):
        assert try_get_optimal_moe_config((E, 2 * I, D), (E, D, I), K, None, m) == moe_config(m, E, I)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_ids_follow_the_tie_rule(block, renormalize):
    """The op's experts equal a stable descending sort of fp32 softmax (ties: lower index first), on random
    logits and on logits full of ties (7 distinct values over 128 experts)."""
    from torchtitan_compat.ops import ReferenceBackend

    be, ref = block[0], ReferenceBackend()
    g = torch.Generator(device="cuda").manual_seed(5)
    ties = (torch.randint(-3, 4, (4096, E), device="cuda", generator=g).float() * 0.5).bfloat16()
    for z in (be.linear(block[1], block[2]), ties):
        assert torch.equal(be.moe_route(z, K, renormalize)[1], ref.moe_route(z, K, renormalize)[1])


def test_experts_equal_fused_experts(block):
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    be, x, _, w13, w2, w, ids = block
    assert torch.equal(be.moe_experts(x, w13, w2, w, ids)[0], fused_experts(x, w13, w2, w, ids))


def test_experts_rows_do_not_depend_on_the_batch(block):
    """A token's output alone (T=1: vLLM's naive one-token blocks), in a shuffled batch and in a slice equals
    its output in the batch of 300 (moe_align_block_size's sorted blocks)."""
    be, x, _, w13, w2, w, ids = block
    y = be.moe_experts(x, w13, w2, w, ids)[0]
    for i in range(0, T, 23):
        assert torch.equal(be.moe_experts(x[i:i + 1], w13, w2, w[i:i + 1], ids[i:i + 1])[0], y[i:i + 1])
    perm = torch.randperm(T, device="cuda", generator=torch.Generator(device="cuda").manual_seed(6))
    assert torch.equal(be.moe_experts(x[perm], w13, w2, w[perm], ids[perm])[0], y[perm])
    assert torch.equal(be.moe_experts(x[5:42], w13, w2, w[5:42], ids[5:42])[0], y[5:42])


def _grads(be, x, wg, w13, w2, routes=None):
    import batch_invariant_backward as bib
    from torchtitan_compat import moe

    leaves = [t.clone().requires_grad_() for t in (x, wg, w13, w2)]
    w, ids = moe.route(bib.linear(leaves[0], leaves[1], be), K, True, be)
    if routes is not None:
        assert torch.equal(ids, routes)
    y = moe.experts(leaves[0], leaves[2], leaves[3], w, ids, be)
    (y.float() * torch.linspace(-1, 1, D, device="cuda")).sum().backward()
    return [t.grad for t in leaves], ids


def test_backward_is_deterministic_and_right(block):
    """The whole sparse block's backward through autograd (the experts' part as grouped GEMMs here): twice the same
    bits; against the reference backend's float32 autograd on the same inputs (the same routes:
    asserted), relative error within 2e-2: the trainer's backward GEMMs take bf16 operands (8 bits of mantissa,
    errors ~4e-3 per rounding, several roundings deep), float32 takes none."""
    from torchtitan_compat.ops import ReferenceBackend

    be, x, wg, w13, w2, _, ids = block
    first, _ = _grads(be, x, wg, w13, w2)
    second, _ = _grads(be, x, wg, w13, w2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))

    class Routed(ReferenceBackend):  # fp32 everything, but the bf16 router logits' routes
        def linear(self, a, b):
            return be.linear(a.bfloat16(), b.bfloat16()).float() if b.shape[0] == E else super().linear(a, b)

    ref, _ = _grads(Routed(), *(t.float() for t in (x, wg, w13, w2)), routes=ids)
    for a, b in zip(first, ref):
        assert float((a.float() - b).norm() / b.norm()) < 2e-2


def _experts_grads(be, x, w13, w2, w, ids, dy, grouped):
    from torchtitan_compat import moe

    c1 = be.moe_experts(x, w13, w2, w, ids)[1]
    return moe.experts_backward(dy, x, w13, w2, w, ids, c1, be, grouped)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_grouped_backward_is_the_path_here(block):
    """On an H100/H200 (compute capability 9.0) the trainer's bf16 experts' backward runs as grouped GEMMs; float32
    and GROUPED_BACKWARD = False take the loop."""
    from torchtitan_compat import moe

    _, x, _, w13, w2, _, _ = block
    assert moe.grouped_backward_runs(x, w13, w2)
    assert not moe.grouped_backward_runs(x.float(), w13.float(), w2.float())
    moe.GROUPED_BACKWARD = False
    try:
        assert not moe.grouped_backward_runs(x, w13, w2)
    finally:
        moe.GROUPED_BACKWARD = True


@pytest.mark.parametrize("t", [1, 300, 4096])
def test_grouped_backward_deterministic_near_loop_and_float32(block, t):
    """The experts' backward as torch._grouped_mm calls at Qwen3-30B-A3B's layer shapes, T tokens, experts 0..15 given
    no rows (their router logits pushed down by 30):
      - run twice: the same bits (torch.equal), for dx, dW13, dW2 and the routing weights' gradient dw;
      - against the per-expert loop on the same inputs, norm-wise within 1e-2 = 2.5 bf16 unit roundoffs (u = 2^-8):
        the grouped GEMMs round V and G to bf16 where the loop keeps fp32, about u on every gradient (measured on the
        CPU in bf16 at these shapes: <= 4.3e-3);
      - against a float32 reference (the reference backend's forward and the loop backward on the same inputs and
        routes upcast to float32), within 2e-2: the bf16 path rounds c1, a, w dy, dc1, V, G and each output to bf16
        (~u each, several deep; the loop path measured ~5.5e-3 on the CPU). dw at T = 1 within 5e-2: its 8 values are
        dot products of 768 terms that cancel, which scales their relative error up (the loop path measured up to
        1.1e-2 there);
      - the idle experts' weight gradients are exactly 0 on all paths."""
    from torchtitan_compat.ops import ReferenceBackend

    be = block[0]
    x, w13, w2 = rand(t, D, seed=11), block[3], block[4]
    z = rand(t, E, seed=12)
    z[:, :16] -= 30
    w, ids = be.moe_route(z, K, True)
    assert not (ids < 16).any()
    dy = rand(t, D, seed=13)
    first = _experts_grads(be, x, w13, w2, w, ids, dy, grouped=True)
    second = _experts_grads(be, x, w13, w2, w, ids, dy, grouped=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    loop = _experts_grads(be, x, w13, w2, w, ids, dy, grouped=False)
    assert all(a.dtype == b.dtype and _rel(a, b) < 1e-2 for a, b in zip(first, loop))
    ref = _experts_grads(ReferenceBackend(), x.float(), w13.float(), w2.float(), w, ids, dy.float(), grouped=False)
    tols = (2e-2, 2e-2, 2e-2, 5e-2 if t == 1 else 2e-2)
    for a, b, tol in zip(first, ref, tols):
        assert _rel(a, b) < tol
    for grads in (first, loop, ref):
        assert not grads[1][:16].any() and not grads[2][:16].any()


def test_expert_lora_gradients_grouped(block):
    """LoRA (rank 16, both expert parameters) at Qwen3-30B-A3B's layer shapes, T = 300, bf16 on the grouped path
    (torchtitan_compat/lora_experts.py): the adapters' gradients twice the same bits, and norm-wise within 1e-2 of
    the same computed through the per-expert loop (the grouped GEMMs round V and G to bf16 once more: about
    u = 2^-8, as above) and within 2e-2 of a float32 reference (the loop on float32 copies of the same tensors)."""
    from torchtitan_compat import moe
    from torchtitan_compat.lora_experts import ExpertsDeltaFunction
    from torchtitan_compat.ops import ReferenceBackend

    be, x, _, w13, w2, w, ids = block
    dy = rand(T, D, seed=21)
    g = torch.Generator(device="cuda").manual_seed(22)
    ab = [(torch.randn(16 * E, p.shape[2], generator=g, device="cuda") * 0.02,
           torch.randn(p.shape[1], 16 * E, generator=g, device="cuda") * 0.02) for p in (w13, w2)]

    def grads(cast, grouped, backend=be):
        leaves = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in ab]
        w13l, w2l = (ExpertsDeltaFunction.apply(cast(p), a, b, 2.0) for p, (a, b) in zip((w13, w2), leaves))
        moe.GROUPED_BACKWARD = grouped
        try:
            (moe.experts(cast(x), w13l, w2l, cast(w), ids, backend).float() * dy.float()).sum().backward()
        finally:
            moe.GROUPED_BACKWARD = True
        return [p.grad for pair in leaves for p in pair]

    first, second = grads(lambda t: t, True), grads(lambda t: t, True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    loop = grads(lambda t: t, False)
    ref = grads(lambda t: t.float(), False, ReferenceBackend())
    for a, b, c in zip(first, loop, ref):
        assert _rel(a, b) < 1e-2 and _rel(a, c) < 2e-2


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    import weights

    out = tmp_path_factory.mktemp("moe") / "ckpt"
    weights.write_random_checkpoint(out, "Qwen3-30B-A3B", num_layers=2, seed=0, dtype=torch.bfloat16)
    return str(out)


def test_engine_parity_matrix_logprobs_and_routes(moe_ckpt, tmp_path):
    """The quick parity matrix on a random 2-layer Qwen3-30B-A3B: 0 logprobs and 0 routes different in every
    case (its own process: one vLLM engine a process)."""
    out = tmp_path / "matrix.json"
    env = {**os.environ, "VLLM_BATCH_INVARIANT": "1"}
    r = subprocess.run([sys.executable, "-m", "compare.parity_matrix", "--model", moe_ckpt, "--quick", "--json",
                        str(out)], env=env, capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    moe_cases = [c for c in results if "routes_compared" in c]
    assert moe_cases and all(c["routes_compared"] > 0 and c["routes_different"] == 0 for c in moe_cases)
    assert all(c["tokens_compared"] > 0 and c["tokens_different"] == 0 for c in results)
