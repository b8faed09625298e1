"""The trainer's GPU backward at Qwen3-1.7B widths: deterministic, close to the float32 backward it
replaced, and unchanged by activation checkpointing or lm_head chunking.

    VLLM_BATCH_INVARIANT=1 python -m pytest tests/gpu/test_trainer_backward_gpu.py -v -s

Model: a random checkpoint of the Qwen3-1.7B shape cut to 2 decoder layers (real widths: hidden
2048, 16/8 heads of 128, MLP 6144, vocab 151936, tied embeddings), bf16, the `vllm` backend. The
loss is what GRPO backpropagates: logprobs of sampled tokens under T = 0.7 and min-p 0.05 plus an
entropy term, over a packed ragged batch (1, 77, 300, 1500 tokens).

Tolerance of the tensor-core backward against the float32 one (the path used before: every GEMM
in float32 from the same saved bf16 activations, the attention backward as a float32 loop), per
parameter as ||g - g_ref|| / ||g_ref||: <= 3e-2. The tensor-core path rounds each GEMM's operands
(incoming gradients, P and dS in attention) to bf16, unit roundoff 2^-8 = 3.9e-3, a few such
roundings per layer compound to ~1e-2 at most; a wrong formula or a missing term is off by O(1).
"""

from __future__ import annotations

import pytest
import torch

import batch_invariant_backward as bib
from spirl.numerics.samples import Sample
from spirl.numerics.parity import SamplingDist, sampled_logprobs_and_entropy

LENGTHS = [1, 77, 300, 1500]
DIST = SamplingDist(temperature=0.7, min_p=0.05)
REL_TOL = 3e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import weights

    out = tmp_path_factory.mktemp("q17") / "ckpt"
    weights.write_random_checkpoint(out, "Qwen3-1.7B", num_layers=2, seed=0, dtype=torch.bfloat16)
    return out


@pytest.fixture(scope="module")
def model(model_dir):
    from weights_vllm_compat import load_model

    return load_model(model_dir, device="cuda", dtype=torch.bfloat16, backend="vllm")


def samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, 151643, (n + 1,), generator=g).tolist()
        out.append(Sample(ids[:1], ids[1:], torch.empty(0)))  # every token after the first is "sampled"
    return out


def grads(model, checkpointing=False):
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing = checkpointing
    try:
        lps, ent = sampled_logprobs_and_entropy(model, samples(), "cuda", DIST, entropy_grad=True)
        loss = -torch.cat(lps).mean() - 0.01 * torch.cat(ent).mean()
        loss.backward()
    finally:
        model.activation_checkpointing = False
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_two_backward_passes_are_bitwise_identical(model):
    a, b = grads(model), grads(model)
    assert a.keys() == b.keys() and len(a) == len(list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in a.values())
    different = [n for n in a if not torch.equal(a[n], b[n])]
    print(f"{len(a)} parameter gradients compared with torch.equal, {len(different)} different")
    assert not different


def test_activation_checkpointing_changes_no_bit(model):
    a, b = grads(model), grads(model, checkpointing=True)
    different = [n for n in a if not torch.equal(a[n], b[n])]
    print(f"{len(a)} parameter gradients compared with torch.equal, {len(different)} different")
    assert not different


def test_tensor_core_backward_is_close_to_the_float32_backward(model, monkeypatch):
    fast = grads(model)
    monkeypatch.setattr(bib, "on_tensor_cores", lambda x: False)  # the float32 GEMMs and attention loop
    slow = grads(model)
    worst = 0.0
    for n in fast:
        err = float((fast[n].float() - slow[n].float()).norm() / slow[n].float().norm().clamp_min(1e-30))
        worst = max(worst, err)
        assert err <= REL_TOL, (n, err)
    print(f"tensor-core vs float32 backward: worst relative error {worst:.2e} over {len(fast)} parameters")


def test_lm_head_chunks_change_no_forward_bit(model, monkeypatch):
    """Chunking lm_head by rows (the default at 16k rows x 152k vocab) gives the same logprobs and
    entropies, bit for bit, as one chunk: the forward GEMM is batch invariant and the sampler ops
    are row-wise. (The backward's cuBLAS GEMMs are deterministic for a given chunking but may pick
    another kernel for another row count, so dh is compared to bf16 rounding.)"""
    h = (torch.randn(700, 2048, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, 151643, (700,), device="cuda")
    w = model.output_weight()

    def run():
        h.grad = None
        lp, ent = bib.lm_head_logprobs(h, w, ids, model.backend, DIST.temperature, DIST.min_p, entropy=True)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), h.grad.clone()

    monkeypatch.setattr(bib, "LOGITS_CHUNK_ELEMENTS", 1 << 40)
    whole = run()
    monkeypatch.setattr(bib, "LOGITS_CHUNK_ELEMENTS", 97 * w.shape[0])
    chunked = run()
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    dh, dh_ref = chunked[2].float(), whole[2].float()
    assert float((dh - dh_ref).norm() / dh_ref.norm()) < 1e-2
