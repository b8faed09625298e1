"""The Triton attention backward (spirl_kernels/attention_backward.py) on the GPU, at realistic shapes.

    VLLM_BATCH_INVARIANT=1 python -m pytest tests/gpu/test_attention_backward_gpu.py -v

(tests/gpu/conftest.py skips everything here without CUDA and vLLM; this file itself needs neither
vLLM nor FlashAttention: out and lse come from the float32 reference forward,
`torchtitan_compat.attention.varlen_causal_attention`, rounded as the real forward returns them -
out in bf16, lse in float32.)

Checked:
  * gradients against the float32 reference backward (`bib.attention`'s AttentionFunction.backward
    fed the same saved out and lse): Qwen3-1.7B's heads (Hq 16, Hk 8, D 128), D 64, GQA 1 and 4,
    on 3 packed sequences of 300, 1000, 2100 tokens, and a 16500-token sequence packed with 1 and
    17. Tolerance ||dx - dx_ref|| / ||dx_ref|| < 2e-2 per tensor: the kernel rounds P and dS to
    bf16 (unit roundoff 2^-8) before their tensor-core products and rounds the outputs to bf16;
    expected error ~6e-3, while a wrong formula is off by O(1);
  * bitwise determinism: two calls give torch.equal dq, dk, dv;
  * batch invariance: each sequence's gradient rows alone are torch.equal to its rows packed with
    the others, in two orders (different offsets and neighbours);
  * every element written (NaN-poisoned outputs, rows outside every sequence come back zero), and
    strided q/k/v views of a fused qkv give the bits of contiguous copies.
"""

from __future__ import annotations

import pytest
import torch

import batch_invariant_backward as bib
from spirl_kernels.attention_backward import attention_backward
from torchtitan_compat.attention import varlen_causal_attention

REL_TOL = 2e-2
LENGTHS = [300, 1000, 2100]
SHAPES = {  # name: (hq, hk, head_dim)
    "qwen3_1.7b_gqa2_d128": (16, 8, 128),
    "gqa2_d64": (16, 8, 64),
    "mha_d128": (8, 8, 128),
    "gqa4_d128": (16, 4, 128),
}


class SavedForward:
    """Backend whose forward returns given (out, lse), so the reference backward sees exactly the
    saved tensors the kernel sees."""

    def __init__(self, out, lse):
        self.out, self.lse = out, lse

    def attention(self, q, k, v, cu_seqlens, max_seqlen, scale):
        return self.out.to(q.dtype), self.lse.to(q.dtype)


def cu_of(lengths, first=0):
    bounds = [first]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return torch.tensor(bounds, dtype=torch.int32, device="cuda")


def make(lengths, hq, hk, d, seed=0, pad_front=0, pad_back=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = pad_front + sum(lengths) + pad_back
    q, k, v, dout = (torch.randn(total, h, d, generator=gen, device="cuda").to(torch.bfloat16)
                     for h in (hq, hk, hk, hq))
    cu = cu_of(lengths, pad_front)
    o, l = varlen_causal_attention(q, k, v, cu, d ** -0.5)
    out, lse = torch.zeros_like(q), torch.zeros(hq, total, device="cuda")
    rows = slice(pad_front, pad_front + sum(lengths))
    out[rows], lse[:, rows] = o[rows], l[:, rows]
    return q, k, v, out, dout, lse, cu


def run(q, k, v, out, dout, lse, cu, poison=False):
    bufs = {}
    if poison:
        bufs = {name: torch.full_like(x, float("nan")) for name, x in (("dq", q), ("dk", k), ("dv", v))}
    max_len = int((cu[1:] - cu[:-1]).max())
    return attention_backward(q, k, v, out, dout, lse, cu, max_len, q.shape[-1] ** -0.5, **bufs)


def reference(q, k, v, out, dout, lse, cu):
    qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
    o = bib.attention(qf, kf, vf, cu, 0, q.shape[-1] ** -0.5, SavedForward(out.float(), lse))
    o.backward(dout.float())
    return qf.grad, kf.grad, vf.grad


def rel(a, b):
    return float((a.float() - b).norm() / b.norm())


def assert_close(got, ref, label):
    errs = {n: rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref)}
    assert all(e < REL_TOL for e in errs.values()), f"{label}: relative errors {errs} (tolerance {REL_TOL})"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_float32_reference(shape):
    args = make(LENGTHS, *SHAPES[shape])
    got = run(*args, poison=True)
    assert all(not g.isnan().any() for g in got), "an output element was never written"
    assert_close(got, reference(*args), shape)


def test_long_sequence_matches_reference_and_is_batch_invariant():
    lengths = [1, 17, 16500]
    args = make(lengths, 16, 8, 128, seed=1)
    got = run(*args)
    assert_close(got, reference(*args), "16500-token sequence")
    q, k, v, out, dout, lse, cu = args
    s, e = int(cu[2]), int(cu[3])
    alone = run(q[s:e], k[s:e], v[s:e], out[s:e], dout[s:e], lse[:, s:e].contiguous(), cu_of([e - s]))
    for a, g in zip(alone, got):
        assert torch.equal(a, g[s:e])


@pytest.mark.parametrize("shape", ["qwen3_1.7b_gqa2_d128", "gqa2_d64", "gqa4_d128"])
def test_bitwise_deterministic(shape):
    args = make(LENGTHS, *SHAPES[shape], seed=2)
    first = run(*args)
    for _ in range(2):
        again = run(*args)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("shape", ["qwen3_1.7b_gqa2_d128", "gqa2_d64", "mha_d128", "gqa4_d128"])
def test_sequence_grads_bitwise_same_alone_or_packed(shape):
    lengths = [300, 1, 1000, 77, 2100]
    q, k, v, out, dout, lse, cu = make(lengths, *SHAPES[shape], seed=3)
    packed = run(q, k, v, out, dout, lse, cu)
    order = list(range(len(lengths)))[::-1]
    perm = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1]), device="cuda") for i in order])
    cu_rev = cu_of([lengths[i] for i in order])
    packed_rev = run(q[perm], k[perm], v[perm], out[perm], dout[perm], lse[:, perm], cu_rev)
    for i, length in enumerate(lengths):
        s, e = int(cu[i]), int(cu[i + 1])
        j = order.index(i)
        sr, er = int(cu_rev[j]), int(cu_rev[j + 1])
        alone = run(q[s:e], k[s:e], v[s:e], out[s:e], dout[s:e], lse[:, s:e].contiguous(), cu_of([length]))
        for name, a, p, r in zip(("dq", "dk", "dv"), alone, packed, packed_rev):
            assert torch.equal(a, p[s:e]), f"{name} of sequence {i} (length {length}) differs alone vs packed"
            assert torch.equal(a, r[sr:er]), f"{name} of sequence {i} (length {length}) differs in reverse packing"


def test_rows_outside_sequences_zero_and_all_written():
    args = make([700, 129], 16, 8, 128, seed=4, pad_front=5, pad_back=11)
    got = run(*args, poison=True)
    total = args[0].shape[0]
    outside = torch.cat([torch.arange(0, 5), torch.arange(total - 11, total)]).cuda()
    for g in got:
        assert not g.isnan().any()
        assert (g[outside] == 0).all()
    assert_close(got, reference(*args), "padded rows")


def test_strided_views_give_contiguous_bits():
    hq, hk, d = 16, 8, 128
    q, k, v, out, dout, lse, cu = make([300, 1000], hq, hk, d, seed=5)
    qkv = torch.cat([q, k, v], dim=1)  # the model's fused projection, split as views
    a = run(qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:], out, dout, lse, cu)
    b = run(q, k, v, out, dout, lse, cu)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
