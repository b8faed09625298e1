"""spirl/loops/precompile.py: which token counts it runs (every GEMM key of a real Qwen3 shape is reached), the
batches it builds, the Triton build counter, and that precompiling leaves a run's bits alone: the same
checkpoint bytes and the same metrics with and without it (on the CPU, where the trainer's warm-up runs the same
forward and backward code; the engine's is vLLM's and runs on a GPU only)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from spirl.core.config import TrainConfig
from spirl.loops import precompile as pc


def _args(shape: str):
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

    return model_args_from_hf_config(hf_config_for_shape(shape))


@pytest.mark.parametrize("shape", ["Qwen3-1.7B", "Qwen3-8B", "Qwen3-32B"])
def test_key_rows_reach_every_gemm_key(shape):
    """Every compiled-kernel key (tile config, row specialization, warp-specialized row-tail boxes) that 1..16,384
    rows give any linear of the shape, computed by brute force here, is given by one of the few rows key_rows
    returns; and each returned row count adds a key. The row-tail boxes (spirl_kernels/gemm_ws.py) add most of them, at
    65-512 rows: 35 rows at Qwen3-1.7B, 61 at 8B when written (17-19 without them)."""
    from spirl_kernels.gemm import compile_key

    body, head = pc.linear_shapes(_args(shape))
    assert len(body) == 4 and head[0] == 151936
    shapes = body + [head]

    def keys(ms):
        return {compile_key(m, n, k) for m in ms for n, k in shapes}

    rows = pc.key_rows(shapes, 16384)
    assert keys(rows) == keys(range(1, 16385))
    assert len(rows) < 80 and rows == sorted(set(rows))
    for i in range(len(rows)):  # no row count is redundant given the ones before it
        assert not keys([rows[i]]) <= keys(rows[:i])


def test_compile_key_tells_row_tails_apart():
    """136 and 144 rows of Qwen3-8B's down projection run the same warp-specialized config with other tail boxes
    (8 and 16 rows past the last full tile): two compiled kernels; 256 and 384 rows leave no tail."""
    from spirl_kernels.gemm import compile_key, pick_config

    n, k = 4096, 12288
    assert pick_config(136, n, k) == pick_config(144, n, k) and pick_config(136, n, k).startswith("ws_")
    assert compile_key(136, n, k) != compile_key(144, n, k)
    assert compile_key(136, n, k) == compile_key(136, n, k)


def test_lengths_and_batches():
    assert pc.lengths_for(10, 4) == [4, 3, 3]
    assert pc.lengths_for(33, 100, 16) == [3] + [2] * 15
    assert pc.lengths_for(3, 100, 3) == []  # every sequence needs 2 tokens (a prompt token and a sampled one)
    assert pc.lengths_for(1, 100) == []
    out = pc.batches([2, 16, 17, 32, 65, 80, 4000], 1000)
    assert [sum(b) for b in out[:7]] == [2, 16, 17, 32, 65, 80, 4000]
    assert all(2 <= n <= 1000 for b in out for n in b)
    extra = out[7:]  # SEQ_COUNTS sequences at 32 (a multiple of 16) and 65 (not)
    assert sorted((sum(b), len(b)) for b in extra) == [(32, 3), (32, 16), (65, 3), (65, 16)]


def test_trainer_batches_cover_lm_head_rows():
    """lm_head sees one row fewer per sequence than the decoder layers: its key rows get batches of their own."""
    args = _args("Qwen3-1.7B")
    body, head = pc.linear_shapes(args)
    sets = pc.trainer_batches(args, 16384, 4096)
    head_rows = {sum(b) - len(b) for b in sets}
    assert set(pc.key_rows([head], 16383)) <= head_rows
    assert set(pc.key_rows(body, 16384)) - {1} <= {sum(b) for b in sets}
    assert max(sum(b) for b in sets) < 4096  # the warm-up is small: the bands end at 2,048 rows


def test_build_counter_chains_and_restores():
    knobs = pytest.importorskip("triton").knobs
    seen = []
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = previous = lambda **kw: seen.append(kw["fn"].name)
    try:
        with pc.TritonBuilds() as builds:
            assert builds.available
            knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="_k"), key=None, repr="_k(X: *bf16D)")
            knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="_k"), key=None, repr="_k(X: *bf16)")
            assert builds.count == 2 and builds.names["_k"] == 2 and seen == ["_k", "_k"] and builds.since(1) == 1
            assert builds.variants == ["_k(X: *bf16D)", "_k(X: *bf16)"]
        assert knobs.runtime.jit_post_compile_hook is previous
    finally:
        knobs.runtime.jit_post_compile_hook = before


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("lora", [pytest.param(False, marks=pytest.mark.slow), True], ids=["full", "lora"])
def test_precompile_changes_no_bits(tiny_ckpt, tmp_path, monkeypatch, lora):
    """Two runs, one with the trainer's warm-up before step 1 (forced on, on the CPU): the same checkpoint bytes
    and the same metrics, but for what the warm-up itself reports."""
    from spirl.loops.run import train

    calls = []
    real = pc.precompile

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    base = dict(model=str(tiny_ckpt), engine="native", dtype="float32", device="cpu", task="synthetic", steps=2,
                prompts_per_step=2, group_size=4, max_new_tokens=4, lr=1e-2 if lora else 1e-3, kl_coef=0.1,
                max_tokens_per_microbatch=40, checkpoint_every=0, out_dir=str(tmp_path / "runs"),
                checkpoint_dir=str(tmp_path / "ckpt"))
    if lora:
        base.update(lora_rank=2, lora_targets="all-linear,lm_head")
    off = train(TrainConfig(**base, run_name="off").validate())
    monkeypatch.setattr(pc, "wanted", lambda cfg, device: True)
    monkeypatch.setattr(pc, "precompile", counted)
    on = train(TrainConfig(**base, run_name="on").validate())
    assert calls == [1]
    assert on[0]["precompile/triton_builds"] == 0 and on[0]["precompile/seconds"] > 0
    drop = ("precompile/", "time/", "memory/")
    strip = lambda h: [{k: v for k, v in s.items() if not k.startswith(drop)} for s in h]  # noqa: E731
    assert strip(on) == strip(off)
    a, b = tmp_path / "ckpt" / "off", tmp_path / "ckpt" / "on"
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert [_sha(a / f) for f in files] == [_sha(b / f) for f in files]


def test_logprob_backward_kernel_ignores_the_alignment_of_row_slices():
    """The trainer slices ids and the incoming gradients per chunk of rows (1,766 rows at Qwen3's vocabulary), so
    a chunk's slice may start 8 bytes past a 16-byte boundary; a kernel specialized on their alignment built a
    second variant in the middle of step 1 (H100, 2026-11-26). They are not specialized on."""
    pytest.importorskip("triton")
    from spirl_kernels.logprob_backward import _logprob_bwd_kernel

    names = {_logprob_bwd_kernel.arg_names[i] if isinstance(i, int) else i for i in _logprob_bwd_kernel.do_not_specialize}
    assert {"IDS", "G", "E"} <= names
