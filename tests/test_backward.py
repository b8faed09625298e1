"""Backward passes of `batch_invariant_backward` against independent references.

Every op is checked, with the reference backend, for:
  * gradients equal to autograd through plain-PyTorch math written out here (float64),
  * torch.autograd.gradcheck (finite differences, float64, small shapes),
  * bitwise-identical gradients over two runs (float32 and bfloat16),
  * a forward that is exactly the backend's output.
Attention is also checked on ragged packed sequences (GQA and not) and for never building an
S x S tensor in its backward.

Tolerances:
  * float64 vs reference math: 1e-10 (abs and rel). Both sides compute the same exact math in a
    different order; float64 rounding (~1e-16 per op) accumulated over reductions of <= 300 terms
    stays many orders below 1e-10, while a wrong formula is off by O(1).
  * float32 vs float64 reference math: 1e-4 (abs and rel). float32 has ~6e-8 unit roundoff;
    reductions of <= 300 terms keep the error well under 1e-4, and a backward secretly computed
    in bfloat16 (~4e-3 roundoff) would fail it.
  * gradcheck: its float64 defaults (eps=1e-6, atol=1e-5, rtol=1e-3).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the repo root holds batch_invariant_backward.py
    sys.path.insert(0, str(ROOT))

import batch_invariant_backward as bib  # noqa: E402
from torchtitan_compat.ops import ReferenceBackend  # noqa: E402

REF = ReferenceBackend()
F64_TOL = dict(atol=1e-10, rtol=1e-10)
F32_TOL = dict(atol=1e-4, rtol=1e-4)
RAGGED_LENGTHS = [1, 7, 130, 300]  # crosses the 128-row block boundary twice


# --------------------------------------------------------------------------------------------
# Plain-PyTorch reference math (autograd differentiates these; nothing from the module under test)
# --------------------------------------------------------------------------------------------


def rms_norm_math(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def silu_and_mul_math(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def linear_math(x, w):
    return x @ w.T


def rotary_math(positions, q, k, cache):
    cos, sin = cache[positions].to(q.dtype).chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    return rotate(q), rotate(k)


def attention_math(q, k, v, cu_seqlens, scale):
    """Dense per-sequence causal softmax(QK^T)V; kv heads repeated for GQA."""
    n_rep = q.shape[1] // k.shape[1]
    outs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].transpose(0, 1).repeat_interleave(n_rep, dim=0)
        vs = v[start:end].transpose(0, 1).repeat_interleave(n_rep, dim=0)
        scores = qs @ ks.transpose(-1, -2) * scale
        future = torch.ones(end - start, end - start, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        outs.append((probs @ vs).transpose(0, 1))
    return torch.cat(outs, dim=0)


# --------------------------------------------------------------------------------------------
# Op cases: (differentiable inputs, wrapped op, reference math), both ops taking the inputs
# --------------------------------------------------------------------------------------------


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def case_rms_norm(dtype, shape=(6, 32)):
    x = _randn(*shape, dtype=dtype, seed=1) * 3
    w = 1 + 0.5 * _randn(shape[-1], dtype=dtype, seed=2)
    eps = 1e-6
    return (x, w), (lambda x, w: bib.rms_norm(x, w, eps, REF)), (lambda x, w: rms_norm_math(x, w, eps))


def case_rms_norm_heads(dtype):
    return case_rms_norm(dtype, shape=(5, 3, 16))


def case_silu_and_mul(dtype, shape=(2, 5, 48)):
    x = _randn(*shape, dtype=dtype, seed=3) * 2
    return (x,), (lambda x: bib.silu_and_mul(x, REF)), silu_and_mul_math


def case_linear(dtype, x_shape=(2, 5, 32), n_out=24):
    x = _randn(*x_shape, dtype=dtype, seed=4)
    w = _randn(n_out, x_shape[-1], dtype=dtype, seed=5) / x_shape[-1] ** 0.5
    return (x, w), (lambda x, w: bib.linear(x, w, REF)), linear_math


def rotary_positions_and_cache(dtype, tokens=7, head_dim=16, max_positions=64):
    """Unordered positions (as in packed sequences) and a float32 (float64 for float64) cache."""
    positions = torch.randint(0, max_positions, (tokens,), generator=torch.Generator().manual_seed(6))
    cache_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return positions, REF.rope_cache(head_dim, max_positions, 10000.0, dtype=cache_dtype, device="cpu")


def case_rotary(dtype, tokens=7, hq=4, hk=2, head_dim=16):
    positions, cache = rotary_positions_and_cache(dtype, tokens, head_dim)
    q = _randn(tokens, hq, head_dim, dtype=dtype, seed=7)
    k = _randn(tokens, hk, head_dim, dtype=dtype, seed=8)
    return (
        (q, k),
        lambda q, k: bib.rotary(positions, q, k, cache, REF),
        lambda q, k: rotary_math(positions, q, k, cache),
    )


def case_qk_norm_rope(dtype, tokens=7, hq=4, hk=2, head_dim=16):
    """Qwen3's q/k step: q and k as strided views of one qkv tensor, as the model passes them."""
    positions, cache = rotary_positions_and_cache(dtype, tokens, head_dim)
    qkv = _randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype, seed=17) * 3
    wq = 1 + 0.5 * _randn(head_dim, dtype=dtype, seed=18)
    wk = 1 + 0.5 * _randn(head_dim, dtype=dtype, seed=19)
    eps, split = 1e-6, [hq * head_dim, hk * head_dim, hk * head_dim]

    def heads(qkv):
        q, k, _ = qkv.split(split, dim=-1)
        return q.view(tokens, hq, head_dim), k.view(tokens, hk, head_dim)

    def wrapped(qkv, wq, wk):
        return bib.qk_norm_rope(positions, *heads(qkv), wq, wk, eps, cache, REF)

    def math(qkv, wq, wk):
        q, k = heads(qkv)
        return rotary_math(positions, rms_norm_math(q, wq, eps), rms_norm_math(k, wk, eps), cache)

    return (qkv, wq, wk), wrapped, math


def case_attention(dtype, lengths=RAGGED_LENGTHS, hq=4, hk=2, head_dim=16, block=128):
    cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    tokens, scale = sum(lengths), head_dim**-0.5
    q = _randn(tokens, hq, head_dim, dtype=dtype, seed=9)
    k = _randn(tokens, hk, head_dim, dtype=dtype, seed=10)
    v = _randn(tokens, hk, head_dim, dtype=dtype, seed=11)
    max_seqlen = max(lengths)
    return (
        (q, k, v),
        lambda q, k, v: bib.attention(q, k, v, cu_seqlens, max_seqlen, scale, REF, block=block),
        lambda q, k, v: attention_math(q, k, v, cu_seqlens, scale),
    )


def case_attention_mha(dtype):
    return case_attention(dtype, hq=4, hk=4)


def case_token_logprobs(dtype, shape=(5, 40)):
    z = _randn(*shape, dtype=dtype, seed=12) * 3
    ids = torch.randint(0, shape[1], (shape[0],), generator=torch.Generator().manual_seed(13))

    def math(z):
        zf = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)
        return torch.log_softmax(zf, -1)[torch.arange(shape[0]), ids]

    return (z,), (lambda z: bib.token_logprobs(z, ids, REF)), math


def lm_head_logprobs_math(h, w, ids, temperature, min_p):
    """(log p(ids), entropy) of softmax(min_p(h W^T / T)) in the compute dtype, written out."""
    cdt = torch.float64 if h.dtype == torch.float64 else torch.float32
    z = (h @ w.T).to(cdt) / temperature
    if min_p:
        z = z.masked_fill(z < z.max(-1, keepdim=True).values + torch.log(torch.tensor(min_p, dtype=cdt)),
                          float("-inf"))
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    finite = logp.masked_fill(p == 0, 0.0)  # cut entries: p log p = 0, and no 0 * inf in autograd
    return logp[torch.arange(h.shape[0]), ids], -(p * finite).sum(-1)


def case_lm_head_logprobs(dtype, rows=6, dim=16, vocab=40, temperature=0.7, min_p=0.05):
    """lm_head + temperature + min-p + token logprob + entropy, the fused op the trainer runs.
    Logits of scale ~4: with min_p 0.05 (log = -3) several entries of each row are cut, none
    within finite-difference reach of the threshold."""
    h = _randn(rows, dim, dtype=dtype, seed=14)
    w = _randn(vocab, dim, dtype=dtype, seed=15)
    ids = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(16))
    ids = torch.where(_kept(h, w, temperature, min_p)[torch.arange(rows), ids], ids, _kept_argmax(h, w))
    return ((h, w), (lambda h, w: bib.lm_head_logprobs(h, w, ids, REF, temperature, min_p, entropy=True)),
            (lambda h, w: lm_head_logprobs_math(h, w, ids, temperature, min_p)))


def _kept(h, w, temperature, min_p):
    z = (h.double() @ w.double().T) / temperature
    return z >= z.max(-1, keepdim=True).values + torch.log(torch.tensor(min_p, dtype=torch.float64))


def _kept_argmax(h, w):
    return (h.double() @ w.double().T).argmax(-1)


def case_lm_head_logprobs_raw(dtype):
    """T = 1 and no min-p (`--logprobs raw`, or sampling at T = 1)."""
    return case_lm_head_logprobs(dtype, temperature=1.0, min_p=0.0)


CASES = {
    "token_logprobs": case_token_logprobs,
    "lm_head_logprobs": case_lm_head_logprobs,
    "lm_head_logprobs_raw": case_lm_head_logprobs_raw,
    "rms_norm": case_rms_norm,
    "rms_norm_heads": case_rms_norm_heads,
    "silu_and_mul": case_silu_and_mul,
    "linear": case_linear,
    "rotary": case_rotary,
    "qk_norm_rope": case_qk_norm_rope,
    "attention_gqa": case_attention,
    "attention_mha": case_attention_mha,
}


def outputs_and_grads(fn, inputs, seed=0):
    """Runs fn on fresh leaf copies of inputs, backpropagates a fixed random upstream gradient
    (random so that no symmetry of a plain sum can hide an error); returns (outputs, grads)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    upstream = [_randn(*o.shape, dtype=o.dtype, seed=seed + i) for i, o in enumerate(outs)]
    grads = torch.autograd.grad(outs, leaves, upstream)
    return [o.detach() for o in outs], list(grads)


# --------------------------------------------------------------------------------------------
# (a, b, d) gradients against independent autograd through the reference math
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_grads_match_reference_math_float64(name):
    inputs, wrapped, math = CASES[name](torch.float64)
    outs, grads = outputs_and_grads(wrapped, inputs)
    ref_outs, ref_grads = outputs_and_grads(math, inputs)
    for out, ref in zip(outs, ref_outs):
        torch.testing.assert_close(out, ref, **F64_TOL)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, **F64_TOL)


@pytest.mark.parametrize("name", CASES)
def test_float32_grads_close_to_float64_math(name):
    inputs, wrapped, _ = CASES[name](torch.float32)
    _, grads = outputs_and_grads(wrapped, inputs)
    inputs64, _, math = CASES[name](torch.float64)
    _, ref_grads = outputs_and_grads(math, inputs64)
    for grad, ref in zip(grads, ref_grads):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad.double(), ref, **F32_TOL)


SMALL_CASES = {
    "token_logprobs": lambda: case_token_logprobs(torch.float64, shape=(3, 6)),
    "lm_head_logprobs": lambda: case_lm_head_logprobs(torch.float64, rows=3, dim=4, vocab=9, min_p=0.02),
    "rms_norm": lambda: case_rms_norm(torch.float64, shape=(3, 8)),
    "rms_norm_heads": lambda: case_rms_norm(torch.float64, shape=(2, 3, 4)),
    "silu_and_mul": lambda: case_silu_and_mul(torch.float64, shape=(3, 10)),
    "linear": lambda: case_linear(torch.float64, x_shape=(2, 3, 6), n_out=5),
    "rotary": lambda: case_rotary(torch.float64, tokens=3, hq=2, hk=1, head_dim=4),
    "qk_norm_rope": lambda: case_qk_norm_rope(torch.float64, tokens=3, hq=2, hk=1, head_dim=4),
    # block=2 so the backward walks several blocks; a zero-length sequence is skipped cleanly
    "attention_gqa": lambda: case_attention(torch.float64, lengths=[1, 5, 0, 4], hq=2, hk=1, head_dim=3, block=2),
    "attention_mha": lambda: case_attention(torch.float64, lengths=[3, 5], hq=2, hk=2, head_dim=3, block=2),
}


@pytest.mark.parametrize("name", SMALL_CASES)
def test_gradcheck_finite_differences(name):
    inputs, wrapped, _ = SMALL_CASES[name]()
    leaves = tuple(t.detach().clone().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(wrapped, leaves)


# --------------------------------------------------------------------------------------------
# (c) determinism and dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CASES)
def test_two_runs_give_bitwise_identical_grads(name, dtype):
    inputs, wrapped, _ = CASES[name](dtype)
    _, first = outputs_and_grads(wrapped, inputs)
    _, second = outputs_and_grads(wrapped, inputs)
    for a, b, x in zip(first, second, inputs):
        assert a.dtype == x.dtype  # gradients come back in the input's dtype
        assert torch.isfinite(a).all()
        assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# Forward is exactly the backend's op
# --------------------------------------------------------------------------------------------


class RecordingBackend(ReferenceBackend):
    """The reference ops, recording which were called."""

    def __init__(self):
        self.calls = []

    def rms_norm(self, *args):
        self.calls.append("rms_norm")
        return super().rms_norm(*args)

    def silu_and_mul(self, *args):
        self.calls.append("silu_and_mul")
        return super().silu_and_mul(*args)

    def linear(self, *args):
        self.calls.append("linear")
        return super().linear(*args)

    def rotary(self, *args):
        self.calls.append("rotary")
        return super().rotary(*args)

    def qk_norm_rope(self, *args):
        self.calls.append("qk_norm_rope")
        return super().qk_norm_rope(*args)

    def attention(self, *args):
        self.calls.append("attention")
        return super().attention(*args)


def test_forward_is_the_backend_output_bitwise():
    """With grad enabled (the autograd.Function path), each op returns exactly what the backend
    it was given returns, and calls that backend once."""
    dt, backend = torch.bfloat16, RecordingBackend()

    def leaf(*shape, seed):
        return _randn(*shape, dtype=dt, seed=seed).requires_grad_()

    x, w = leaf(6, 32, seed=1), leaf(32, seed=2)
    assert torch.equal(bib.rms_norm(x, w, 1e-6, backend), REF.rms_norm(x, w, 1e-6))

    gate_up = leaf(6, 48, seed=3)
    assert torch.equal(bib.silu_and_mul(gate_up, backend), REF.silu_and_mul(gate_up))

    w_lin = leaf(24, 32, seed=4)
    assert torch.equal(bib.linear(x, w_lin, backend), REF.linear(x, w_lin))

    positions, cache = rotary_positions_and_cache(dt)
    q, k = leaf(7, 4, 16, seed=5), leaf(7, 2, 16, seed=6)
    got, want = bib.rotary(positions, q, k, cache, backend), REF.rotary(positions, q, k, cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    wq, wk = leaf(16, seed=10), leaf(16, seed=11)
    got = bib.qk_norm_rope(positions, q, k, wq, wk, 1e-6, cache, backend)
    want = REF.qk_norm_rope(positions, q, k, wq, wk, 1e-6, cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    cu_seqlens = torch.tensor([0, 1, 8, 138, 438], dtype=torch.int32)
    q, k, v = leaf(438, 4, 16, seed=7), leaf(438, 2, 16, seed=8), leaf(438, 2, 16, seed=9)
    got = bib.attention(q, k, v, cu_seqlens, 300, 0.25, backend)
    assert torch.equal(got, REF.attention(q, k, v, cu_seqlens, 300, 0.25)[0])

    # qk_norm_rope runs as the backend's one op (the reference composes two of its own inside)
    assert backend.calls == ["rms_norm", "silu_and_mul", "linear", "rotary", "qk_norm_rope", "rms_norm",
                             "rms_norm", "rotary", "attention"]


@pytest.mark.parametrize("name", CASES)
def test_no_grad_forward_matches_and_builds_no_graph(name):
    inputs, wrapped, _ = CASES[name](torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in inputs]
    with_grad = wrapped(*leaves)
    with torch.no_grad():
        without = wrapped(*leaves)
    with_grad = with_grad if isinstance(with_grad, tuple) else (with_grad,)
    without = without if isinstance(without, tuple) else (without,)
    for a, b in zip(with_grad, without):
        assert a.grad_fn is not None and b.grad_fn is None
        assert torch.equal(a, b)


class InPlaceRotaryBackend(ReferenceBackend):
    """Rotates q and k in place and returns them, as vLLM's rotary kernel does."""

    def rotary(self, positions, q, k, cos_sin_cache):
        q_rot, k_rot = super().rotary(positions, q, k, cos_sin_cache)
        return q.copy_(q_rot), k.copy_(k_rot)


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_rotary_never_mutates_its_inputs(grad_enabled):
    (q, k), _, math = case_rotary(torch.float64)
    positions, cache = rotary_positions_and_cache(torch.float64)
    q_leaf, k_leaf = q.clone().requires_grad_(), k.clone().requires_grad_()
    with torch.set_grad_enabled(grad_enabled):
        q_rot, k_rot = bib.rotary(positions, q_leaf, k_leaf, cache, InPlaceRotaryBackend())
    assert torch.equal(q_leaf.detach(), q) and torch.equal(k_leaf.detach(), k)
    want_q, want_k = math(q, k)
    assert torch.equal(q_rot.detach(), want_q) and torch.equal(k_rot.detach(), want_k)
    if grad_enabled:  # the saved-input check of autograd would also trip on a mutated leaf
        (q_rot.sum() + k_rot.sum()).backward()
        assert q_leaf.grad is not None and k_leaf.grad is not None


# --------------------------------------------------------------------------------------------
# (e) the attention backward never builds an S x S tensor
# --------------------------------------------------------------------------------------------


class LargestTensorSpy(TorchDispatchMode):
    """Records the largest numel among the outputs of every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.max_op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.max_op = t.numel(), func
        return out


def _largest_tensor_in_backward(out, upstream):
    spy = LargestTensorSpy()
    with spy:
        out.backward(upstream)
    return spy


def test_spy_catches_a_dense_backward():
    """Positive control: autograd through dense attention does build [H, S, S] in its backward,
    and the spy sees it - so the bound below is a check that can fail."""
    seq, heads = 512, 2
    (q, k, v), _, math = case_attention(torch.float32, lengths=[seq], hq=heads, hk=1, head_dim=8)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = math(*leaves)
    spy = _largest_tensor_in_backward(out, torch.ones_like(out))
    assert spy.max_numel >= seq * seq


def test_attention_backward_memory_is_block_by_seq_not_seq_by_seq():
    seq, heads, block, head_dim = 4096, 2, 128, 8
    (q, k, v), wrapped, _ = case_attention(torch.float32, lengths=[seq], hq=heads, hk=1, head_dim=head_dim,
                                           block=block)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = wrapped(*leaves)
    spy = _largest_tensor_in_backward(out, torch.ones_like(out))
    # The largest intermediate is one [heads, block, seq] probability slab: 1/32 of one head's
    # seq x seq matrix here. Any single-head S x S tensor (16.7M elements) would exceed it.
    assert spy.max_numel <= heads * block * seq < seq * seq, (spy.max_numel, spy.max_op)
    assert all(torch.isfinite(t.grad).all() for t in leaves)


# --------------------------------------------------------------------------------------------
# lm_head_logprobs: chunking changes no bit; entropy unused costs no gradient term
# --------------------------------------------------------------------------------------------


def test_lm_head_logprobs_chunking_is_exact():
    """Rows are processed in chunks of LOGITS_CHUNK_ELEMENTS // vocab rows: one chunk and chunks of
    1, 2 and 5 rows give the same values and gradients (float64, to 1e-12: on the CPU a GEMM's
    blocking - and so its last bits - depends on its row count; on the GPU the batch-invariant
    GEMM makes them bitwise equal, tests/gpu/test_trainer_backward_gpu.py)."""
    (h, w), wrapped, _ = case_lm_head_logprobs(torch.float64, rows=11)
    outs, grads = outputs_and_grads(wrapped, (h, w))
    for rows_per_chunk in (1, 2, 5):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bib, "LOGITS_CHUNK_ELEMENTS", rows_per_chunk * w.shape[0])
            assert len(bib._row_chunks(11, w.shape[0])) == -(-11 // rows_per_chunk)
            outs_c, grads_c = outputs_and_grads(wrapped, (h, w))
        for a, b in zip(outs + grads, outs_c + grads_c):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_lm_head_logprobs_forward_is_the_unfused_ops_bitwise():
    """lp = backend.token_logprobs(backend.sampling_logits(backend.linear(h, W))), bit for bit."""
    (h, w), wrapped, _ = case_lm_head_logprobs(torch.bfloat16, rows=9)
    ids = torch.arange(9) % 40
    lp, _ = bib.lm_head_logprobs(h, w, ids, REF, 0.7, 0.05)
    assert torch.equal(lp, REF.token_logprobs(REF.sampling_logits(REF.linear(h, w), 0.7, 0.05), ids))


def test_sampling_logits_match_float64_reference():
    """The reference backend's temperature and min-p (vLLM's order: divide in float32, round to the
    logits' dtype, then cut below max + log(min_p)) against float64 math: within one rounding of
    the logits' dtype (bf16: 2^-8 relative), and the same entries cut."""
    z = _randn(7, 300, dtype=torch.bfloat16, seed=21) * 4
    for temperature, min_p in [(0.7, 0.0), (1.3, 0.1), (1.0, 0.05)]:
        got = REF.sampling_logits(z, temperature, min_p)
        want = z.double() / temperature
        cut = want < want.max(-1, keepdim=True).values + torch.log(torch.tensor(min_p, dtype=torch.float64))
        assert got.dtype == torch.bfloat16
        assert torch.equal(torch.isinf(got), cut if min_p else torch.zeros_like(cut))
        kept = ~cut if min_p else torch.ones_like(cut)
        torch.testing.assert_close(got.double()[kept], want[kept], atol=0, rtol=2**-8)
    assert REF.sampling_logits(z, 1.0, 0.0) is z


def test_unused_entropy_output_adds_no_gradient():
    """When only the logprobs reach the loss, the gradient is that of the logprobs alone."""
    (h, w), _, _ = case_lm_head_logprobs(torch.float64)
    ids = torch.arange(6)
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    lp, ent = bib.lm_head_logprobs(*leaves, ids, REF, 0.7, 0.0, entropy=True)
    g1 = torch.autograd.grad(lp.sum(), leaves)
    leaves2 = [t.clone().requires_grad_() for t in (h, w)]
    lp2, _ = bib.lm_head_logprobs(*leaves2, ids, REF, 0.7, 0.0)
    g2 = torch.autograd.grad(lp2.sum(), leaves2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
