"""Backward passes for the kernel-backend ops (`torchtitan_compat/ops.py`).

vLLM's kernels are forward-only. Each op here is a `torch.autograd.Function` whose forward calls
the backend's op unchanged - its output is the backend's output bit for bit, which is what
trainer/rollout parity depends on - and whose backward is written out in plain PyTorch.

Every backward is deterministic: dense matmuls and reductions over fixed shapes in a fixed
order, no atomics, no scatter/index_add with duplicate indices. Two identical backward passes
give bitwise-identical gradients.

Precision and speed: on CUDA with bf16/fp16 activations (training), every GEMM of a backward
(dX, dW of each linear and of lm_head) is a bf16 tensor-core GEMM with fp32 accumulation
(cuBLAS: a fixed algorithm for fixed shapes, hence fixed bits), and the attention backward is
the Triton kernel of `spirl_kernels/attention_backward.py` (separate dK/dV and dQ passes, no atomics),
and the row-wise backwards (RMSNorm, SiLU-and-mul, rotary, the logprob/entropy over the vocabulary)
are single-pass Triton kernels (`spirl_kernels/pointwise_backward.py`, `spirl_kernels/logprob_backward.py`)
doing the math written in each Function's docstring in fp32 registers. Elsewhere (CPU, float32/float64 models, the
gradient checks) every backward is computed in float32 (float64 for float64 inputs). Gradients
are cast back to the dtype of the input they belong to.

Public functional API (what the model calls):
    rms_norm(x, weight, eps, backend)
    silu_and_mul(x, backend)
    linear(x, weight, backend)
    rotary(positions, q, k, cos_sin_cache, backend) -> (q_rot, k_rot)
    attention(q, k, v, cu_seqlens, max_seqlen, scale, backend, block=128) -> out
    token_logprobs(logits, ids, backend) -> float32 [T]
    lora_linear(x, merged_weight, slices, scale, backend, adapters)   (gradients for the LoRA adapters)
    lm_head_logprobs(h, weight, ids, backend, temperature, min_p, entropy, lora) -> (float32 [N], [N] | None)

When no input needs a gradient (or under `torch.no_grad()`), these call the backend directly and
save nothing.
"""

from __future__ import annotations

import torch

# Output rows of W whose weight gradient is formed per float32 matmul in `linear`'s backward.
# Bounds the float32 copy of the incoming gradient (an lm_head's g is [T, vocab]).
WEIGHT_GRAD_ROW_CHUNK = 16384


# --------------------------------------------------------------------------------------------
# Shared helpers (also used by the reference forward in torchtitan_compat/attention.py)
# --------------------------------------------------------------------------------------------

DEFAULT_BLOCK = 128


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (gradient checks); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[Hk, S, D] -> [Hk * n_rep, S, D], kv head h // n_rep serving query head h."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=0)


def causal_block_scores(q_blk: torch.Tensor, k_seen: torch.Tensor, q_start: int, scale: float):
    """Scaled scores [H, Bq, Sk] of query rows q_start.. against keys 0..Sk-1, future keys masked."""
    scores = torch.matmul(q_blk, k_seen.transpose(-1, -2)) * scale
    rows = torch.arange(q_start, q_start + q_blk.shape[-2], device=q_blk.device)
    cols = torch.arange(k_seen.shape[-2], device=q_blk.device)
    return scores.masked_fill(cols[None, :] > rows[:, None], float("-inf"))


def iter_sequences(cu_seqlens: torch.Tensor):
    """(start, end) row ranges of the packed sequences."""
    bounds = cu_seqlens.tolist()
    return zip(bounds[:-1], bounds[1:])


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def on_tensor_cores(x: torch.Tensor) -> bool:
    """Training precision on a GPU: the backward's GEMMs run as bf16/fp16 tensor-core GEMMs."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b returned in out_dtype. Tensor-core inputs: one bf16/fp16 GEMM with fp32 accumulation
    (cuBLAS; `out_dtype=float32` keeps the fp32 accumulator unrounded). Otherwise: in the compute
    dtype (float32, or float64 for float64 inputs)."""
    if on_tensor_cores(a):
        if out_dtype == torch.float32:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b).to(out_dtype)
    cdt = compute_dtype(a.dtype)
    return torch.mm(a.to(cdt), b.to(cdt)).to(out_dtype)


# --------------------------------------------------------------------------------------------
# RMSNorm
# --------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    """y = backend.rms_norm(x, w, eps), normalising over the last dim (size N).

    Forward (per row x of length N):
        r = 1 / sqrt(mean(x^2) + eps)
        y = (x * r) * w
    Backward, with gw = g * w:
        dx = r * gw - x * r^3 * mean(gw * x)
        dw = sum over rows of g * x * r
    """

    @staticmethod
    def forward(ctx, x, weight, eps, backend):
        y = backend.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        dx, dw = _rms_norm_grads(x, weight, grad_out, ctx.eps, *ctx.needs_input_grad[:2])
        return dx, dw, None, None


def _rms_norm_grads(x, weight, grad_out, eps: float, need_dx: bool = True, need_dw: bool = True):
    """(dx, dw) of y = rms_norm(x) * weight (RMSNormFunction's math), None where not needed."""
    if on_tensor_cores(x):  # one fused pass (spirl_kernels.pointwise_backward), same math
        from spirl_kernels.pointwise_backward import rms_norm_backward

        dx, dw = rms_norm_backward(x, weight, grad_out, eps)
        return dx, dw.to(weight.dtype)
    cdt = compute_dtype(x.dtype)
    xf, wf, g = x.to(cdt), weight.to(cdt), grad_out.to(cdt)
    n = x.shape[-1]
    # sum / n, not .mean(): vLLM's batch-invariant mode reroutes aten mean.dim to a slower
    # Triton kernel in the engine's process; the math is the same.
    r = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) / n + eps)
    dx = dw = None
    if need_dx:
        gw = g * wf
        dx = (r * gw - xf * r.pow(3) * ((gw * xf).sum(-1, keepdim=True) / n)).to(x.dtype)
    if need_dw:
        dw = (g * xf * r).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return dx, dw


def rms_norm(x, weight, eps: float, backend):
    """RMSNorm over the last dim of x ([T, N] or [T, H, D]) with weight [N]."""
    if not _needs_grad(x, weight):
        return backend.rms_norm(x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps, backend)


# --------------------------------------------------------------------------------------------
# SiLU-and-mul (the SwiGLU gate)
# --------------------------------------------------------------------------------------------


class SiluAndMulFunction(torch.autograd.Function):
    """out = backend.silu_and_mul(x) for x = [a | b] (last dim 2I, halves of size I).

    Forward:
        out = silu(a) * b,   silu(a) = a * sigmoid(a)
    Backward, with s = sigmoid(a):
        da = g * b * s * (1 + a * (1 - s))
        db = g * silu(a)
    """

    @staticmethod
    def forward(ctx, x, backend):
        out = backend.silu_and_mul(x)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return silu_and_mul_grad(x, grad_out), None


def silu_and_mul_grad(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """dL/dx of out = silu_and_mul(x) (SiluAndMulFunction's math), in x's dtype."""
    if on_tensor_cores(x):  # one fused pass (spirl_kernels.pointwise_backward), same math
        from spirl_kernels.pointwise_backward import swiglu_backward

        return swiglu_backward(x, grad_out)
    cdt = compute_dtype(x.dtype)
    a, b = x.to(cdt).chunk(2, dim=-1)
    g = grad_out.to(cdt)
    s = torch.sigmoid(a)
    da = g * b * s * (1 + a * (1 - s))
    db = g * a * s
    return torch.cat([da, db], dim=-1).to(x.dtype)


def silu_and_mul(x, backend):
    """silu(x[..., :I]) * x[..., I:]."""
    if not _needs_grad(x):
        return backend.silu_and_mul(x)
    return SiluAndMulFunction.apply(x, backend)


# --------------------------------------------------------------------------------------------
# Linear (no bias)
# --------------------------------------------------------------------------------------------


def _weight_grad(g2: torch.Tensor, x2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dW = g2^T x2 ([N, T] @ [T, K]) accumulated in float32 (float64 for float64), cast to
    out_dtype. Tensor-core inputs: one bf16 GEMM. Otherwise formed in fixed chunks of output rows
    so the upcast copy of g2 stays bounded; each element's reduction over T is one matmul, so the
    chunking does not change the math."""
    if on_tensor_cores(g2):
        return _mm(g2.t(), x2, out_dtype)
    cdt = compute_dtype(g2.dtype)
    xc = x2.to(cdt)
    n_out = g2.shape[1]
    dw = torch.empty(n_out, x2.shape[1], dtype=out_dtype, device=g2.device)
    for j0 in range(0, n_out, WEIGHT_GRAD_ROW_CHUNK):
        j1 = min(j0 + WEIGHT_GRAD_ROW_CHUNK, n_out)
        dw[j0:j1] = torch.matmul(g2[:, j0:j1].to(cdt).t(), xc).to(out_dtype)
    return dw


class LinearFunction(torch.autograd.Function):
    """y = backend.linear(x, W) for x [..., K], W [N, K].

    Forward:
        y = x W^T
    Backward (leading dims of x and g flattened to rows):
        dx = g W
        dW = g^T x   (accumulated in float32 for low-precision inputs, then cast to W's dtype)
    On a GPU in bf16/fp16 both are tensor-core GEMMs with fp32 accumulation (`_mm`).
    """

    @staticmethod
    def forward(ctx, x, weight, backend):
        y = backend.linear(x, weight)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, weight.shape[0])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _mm(g2, weight, x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(g2, x.reshape(-1, x.shape[-1]), weight.dtype)
        return dx, dw, None


def linear(x, weight, backend):
    """x W^T without bias."""
    if not _needs_grad(x, weight):
        return backend.linear(x, weight)
    return LinearFunction.apply(x, weight, backend)


# --------------------------------------------------------------------------------------------
# LoRA on a merged weight
# --------------------------------------------------------------------------------------------


def _lora_grads(g2, x2, a, b, scale: float, need_a: bool = True, need_b: bool = True):
    """(dA, dB) of one LoRA adapter whose update s B A is merged into W' of y = x W'^T, from the
    output gradient g2 [T, N] (this adapter's output rows) and the input x2 [T, K]; A [r, K], B [N, r]:
        u = x A^T   [T, r]          v = g B   [T, r]
        dB = s g^T u   [N, r]       dA = s v^T x   [r, K]
    Low-rank products only: no [N, K] gradient is ever formed. Returned in the adapter's dtype
    (the float32 masters). Tensor-core inputs: bf16 operands with fp32 accumulation (u and v are
    kept in fp32 and rounded to bf16 only as GEMM operands); otherwise the compute dtype."""
    lowp = on_tensor_cores(x2)
    cdt = torch.float32 if lowp else compute_dtype(x2.dtype)
    op = x2.dtype if lowp else cdt  # the dtype GEMM operands are given in

    def mm(p, q):
        return _mm(p.to(op), q.to(op), cdt)

    da = db = None
    if need_b:
        db = (mm(g2.t(), mm(x2, a.t())) * scale).to(b.dtype)
    if need_a:
        da = (mm(mm(g2, b).t(), x2) * scale).to(a.dtype)
    return da, db


class LoRALinearFunction(torch.autograd.Function):
    """y = backend.linear(x, W') for a weight W' [N, K] into which LoRA adapters are merged: row
    block i (rows o_i .. o_i + n_i) of W' is bf16(W_i + s B_i A_i), A_i [r, K], B_i [n_i, r], with
    W the frozen base (spirl's LoRA keeps W' in the engine; see torchtitan_compat/lora.py).

    Forward: exactly the plain linear's, y = x W'^T (the same kernel on the same W' the rollout
    engine serves, so the logprobs are the engine's bit for bit).
    Backward, taking the bf16 rounding of W' as the identity (the usual mixed-precision
    straight-through step), with g_i = g[:, o_i : o_i + n_i]:
        dx   = g W'
        dB_i = s g_i^T (x A_i^T)
        dA_i = s (g_i B_i)^T x
    and no gradient for W' (frozen). `slices` = ((o_i, n_i), ...), `adapters` = (A_0, B_0, A_1, ...).
    """

    @staticmethod
    def forward(ctx, x, weight, slices, scale, backend, *adapters):
        ctx.save_for_backward(x, weight, *adapters)
        ctx.slices, ctx.scale = slices, scale
        return backend.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, *adapters = ctx.saved_tensors
        need = ctx.needs_input_grad
        g2 = grad_out.reshape(-1, weight.shape[0])
        x2 = x.reshape(-1, x.shape[-1])
        dx = _mm(g2, weight, x.dtype).reshape(x.shape) if need[0] else None
        grads = []
        for i, (o, n) in enumerate(ctx.slices):
            need_a, need_b = need[5 + 2 * i], need[6 + 2 * i]
            grads += _lora_grads(g2[:, o:o + n], x2, adapters[2 * i], adapters[2 * i + 1], ctx.scale,
                                 need_a, need_b) if need_a or need_b else (None, None)
        return (dx, None, None, None, None, *grads)


def lora_linear(x, weight, slices, scale: float, backend, adapters):
    """x W'^T for a merged LoRA weight W' (LoRALinearFunction), differentiable in x and in the
    adapters (A_0, B_0, A_1, B_1, ...) of the row blocks `slices`."""
    if not _needs_grad(x, *adapters):
        return backend.linear(x, weight)
    return LoRALinearFunction.apply(x, weight, tuple(slices), scale, backend, *adapters)


# --------------------------------------------------------------------------------------------
# Rotary embedding (neox style)
# --------------------------------------------------------------------------------------------


def _cos_sin(cos_sin_cache, positions, dtype):
    """cos, sin [T, D/2] in the compute dtype of `dtype`. The cache is first cast to the
    activation dtype because that is the coefficient the forward applies (vLLM keeps the cache
    in the model dtype); the backward must rotate back by that same matrix."""
    cos, sin = cos_sin_cache[positions].to(dtype).to(compute_dtype(dtype)).chunk(2, dim=-1)
    return cos[:, None, :], sin[:, None, :]


def _inverse_rotate_neox(grad, cos, sin):
    """Transpose of (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin):
    (g1, g2) -> (g1 cos + g2 sin, g2 cos - g1 sin)."""
    g1, g2 = grad.chunk(2, dim=-1)
    return torch.cat([g1 * cos + g2 * sin, g2 * cos - g1 * sin], dim=-1)


class RotaryFunction(torch.autograd.Function):
    """(q_rot, k_rot) = backend.rotary(positions, q, k, cos_sin_cache); q [T, Hq, D], k [T, Hk, D].

    Forward (neox: each head split into halves x1, x2; c, s = cos, sin of the token's position):
        (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)
    Backward (a rotation's transpose is its inverse):
        (g1, g2) -> (g1 c + g2 s, g2 c - g1 s)
    No gradient for positions or the cache.
    """

    @staticmethod
    def forward(ctx, positions, q, k, cos_sin_cache, backend):
        q_rot, k_rot = _rotary_on_copies(positions, q, k, cos_sin_cache, backend)
        ctx.save_for_backward(positions, cos_sin_cache)
        ctx.q_dtype, ctx.k_dtype = q.dtype, k.dtype
        return q_rot, k_rot

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        positions, cos_sin_cache = ctx.saved_tensors
        dq = _rotary_grad(grad_q, positions, cos_sin_cache, ctx.q_dtype) if ctx.needs_input_grad[1] else None
        dk = _rotary_grad(grad_k, positions, cos_sin_cache, ctx.k_dtype) if ctx.needs_input_grad[2] else None
        return None, dq, dk, None, None


def _rotary_grad(grad, positions, cos_sin_cache, dtype):
    """dx (in `dtype`) of the neox rotation from its output's gradient (RotaryFunction's math);
    None for None."""
    if grad is None:
        return None
    if _fused_rotary(grad, dtype):
        from spirl_kernels.pointwise_backward import rotary_backward

        return rotary_backward(grad, positions, cos_sin_cache, dtype)
    cos, sin = _cos_sin(cos_sin_cache, positions, dtype)
    return _inverse_rotate_neox(grad.to(cos.dtype), cos, sin).to(dtype)


def _fused_rotary(grad: torch.Tensor, dtype: torch.dtype) -> bool:
    """The Triton rotary backward runs: a GPU, training precision, a power-of-two half head."""
    half = grad.shape[-1] // 2
    return grad.is_cuda and dtype in (torch.bfloat16, torch.float16) and half >= 1 and half & (half - 1) == 0


def _rotary_on_copies(positions, q, k, cos_sin_cache, backend):
    # vLLM's rotary kernel rotates in place; hand it copies so the caller's q and k (autograd
    # inputs, possibly views of a fused qkv) are never mutated.
    return backend.rotary(positions, q.clone(), k.clone(), cos_sin_cache)


def rotary(positions, q, k, cos_sin_cache, backend):
    """Neox rotary embedding of q and k at `positions`; never mutates q or k."""
    if not _needs_grad(q, k):
        return _rotary_on_copies(positions, q, k, cos_sin_cache, backend)
    return RotaryFunction.apply(positions, q, k, cos_sin_cache, backend)


class QKNormRopeFunction(torch.autograd.Function):
    """(q_out, k_out) = backend.qk_norm_rope(positions, q, k, wq, wk, eps, cos_sin_cache): Qwen3's
    per-head RMSNorm of q [T, Hq, D] and k [T, Hk, D], then the neox rotation, as one op (vLLM runs
    two kernels; the backends give the same bits either way).

    Forward, per head row x with r = 1 / sqrt(mean(x^2) + eps) and c, s the cos, sin of the token's
    position:
        y = (x * r) * w,   (y1, y2) -> (y1 c - y2 s, y2 c + y1 s)
    Backward: the rotation's transpose (RotaryFunction), then RMSNorm's (RMSNormFunction):
        gy = (g1 c + g2 s, g2 c - g1 s)
        dx = r * gy w - x r^3 mean(gy w x),   dw = sum over rows of gy x r
    Saves q and k (views of the qkv output) and recomputes r; nothing [T, H, D] of its own.
    """

    @staticmethod
    def forward(ctx, positions, q, k, q_weight, k_weight, eps, cos_sin_cache, backend):
        ctx.save_for_backward(positions, q, k, q_weight, k_weight, cos_sin_cache)
        ctx.eps = eps
        return backend.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, cos_sin_cache)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        positions, q, k, q_weight, k_weight, cos_sin_cache = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq = dk = dwq = dwk = None
        if grad_q is not None and (need[1] or need[3]):
            gy = _rotary_grad(grad_q, positions, cos_sin_cache, q.dtype)
            dq, dwq = _rms_norm_grads(q, q_weight, gy, ctx.eps, need[1], need[3])
        if grad_k is not None and (need[2] or need[4]):
            gy = _rotary_grad(grad_k, positions, cos_sin_cache, k.dtype)
            dk, dwk = _rms_norm_grads(k, k_weight, gy, ctx.eps, need[2], need[4])
        return None, dq, dk, dwq, dwk, None, None, None


def qk_norm_rope(positions, q, k, q_weight, k_weight, eps: float, cos_sin_cache, backend):
    """rotary(rms_norm(q) * q_weight, rms_norm(k) * k_weight) at `positions`, heads q [T, Hq, D]
    and k [T, Hk, D] (views of the qkv output are fine); new tensors, q and k never mutated."""
    if not _needs_grad(q, k, q_weight, k_weight):
        return backend.qk_norm_rope(positions, q, k, q_weight, k_weight, eps, cos_sin_cache)
    return QKNormRopeFunction.apply(positions, q, k, q_weight, k_weight, eps, cos_sin_cache, backend)


# --------------------------------------------------------------------------------------------
# Varlen causal attention
# --------------------------------------------------------------------------------------------


def _heads_first(x: torch.Tensor, start: int, end: int, dtype) -> torch.Tensor:
    """Rows start:end of a [T, H, D] tensor as [H, L, D] in `dtype`."""
    return x[start:end].transpose(0, 1).to(dtype)


def _sum_head_groups(dx_expanded: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """[Hq, L, D] -> [Hk, L, D]: sums the n_rep query heads that shared each kv head (the
    transpose of `expand_kv`'s repeat_interleave), as a view + sum in a fixed order."""
    hq, length, d = dx_expanded.shape
    return dx_expanded.view(n_kv_heads, hq // n_kv_heads, length, d).sum(1)


def _sequence_attention_backward(qs, ks, vs, outs, douts, lse, scale: float, block: int):
    """Gradients of one sequence's causal attention, all tensors [H, L, D] (lse [H, L]) in the
    compute dtype with kv heads already expanded to H. Walks query blocks as the forward does;
    each block's probabilities are recomputed from the saved lse, so the largest intermediate
    is one [H, block, L] slab."""
    length = qs.shape[1]
    delta = (douts * outs).sum(-1)  # D = rowsum(dO * O), [H, L]
    dq = torch.empty_like(qs)
    dk = torch.zeros_like(ks)
    dv = torch.zeros_like(vs)
    for i0 in range(0, length, block):
        i1 = min(i0 + block, length)
        q_blk, do_blk = qs[:, i0:i1], douts[:, i0:i1]
        k_seen, v_seen = ks[:, :i1], vs[:, :i1]
        probs = torch.exp(causal_block_scores(q_blk, k_seen, i0, scale) - lse[:, i0:i1, None])
        dv[:, :i1] += torch.matmul(probs.transpose(-1, -2), do_blk)
        dprobs = torch.matmul(do_blk, v_seen.transpose(-1, -2))
        dscores = probs * (dprobs - delta[:, i0:i1, None])
        dq[:, i0:i1] = torch.matmul(dscores, k_seen) * scale
        dk[:, :i1] += torch.matmul(dscores.transpose(-1, -2), q_blk) * scale
    return dq, dk, dv


class AttentionFunction(torch.autograd.Function):
    """out = backend.attention(q, k, v, cu_seqlens, max_seqlen, scale)[0]: causal attention over
    packed variable-length sequences; q [T, Hq, D], k/v [T, Hk, D], query head h reads kv head
    h // (Hq / Hk).

    Forward, per sequence and head (the backend also returns lse, which is saved):
        S = scale * Q K^T (future keys masked), lse = logsumexp_rows(S)
        P = exp(S - lse),  O = P V
    Backward, per sequence, walking blocks of `block` query rows against the keys they see
    (never an S x S matrix; P is recomputed from the saved lse):
        D  = rowsum(dO * O)            (once per row)
        dV += P^T dO
        dP = dO V^T
        dS = P * (dP - D)
        dQ_blk = scale * dS K
        dK += scale * dS^T Q_blk
    then dK, dV of the Hq/Hk query heads sharing a kv head are summed. Accumulation is in
    float32 (float64 for float64 inputs).
    On a GPU in bf16/fp16 with a head dim it is tuned for, the same math runs fused in Triton
    (`spirl_kernels.attention_backward`: tensor cores, fp32 accumulation, no atomics, one writer per
    output element); the loop above is the reference for everything else.
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, backend, block):
        out, lse = backend.attention(q, k, v, cu_seqlens, max_seqlen, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.scale, ctx.block, ctx.max_seqlen = scale, block, max_seqlen
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        if fused_attention_backward_supported(q):
            from spirl_kernels.attention_backward import attention_backward

            dq, dk, dv = attention_backward(q, k, v, out, grad_out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
            return dq, dk, dv, None, None, None, None, None
        cdt = compute_dtype(q.dtype)
        n_kv = k.shape[1]
        n_rep = q.shape[1] // n_kv
        # zeros: rows outside every sequence (cu_seqlens not covering T) get no gradient.
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for start, end in iter_sequences(cu_seqlens):
            if end == start:
                continue
            grads = _sequence_attention_backward(
                qs=_heads_first(q, start, end, cdt),
                ks=expand_kv(_heads_first(k, start, end, cdt), n_rep),
                vs=expand_kv(_heads_first(v, start, end, cdt), n_rep),
                outs=_heads_first(out, start, end, cdt),
                douts=_heads_first(grad_out, start, end, cdt),
                lse=lse[:, start:end].to(cdt),
                scale=ctx.scale,
                block=ctx.block,
            )
            dq_s, dk_s, dv_s = grads
            dq[start:end] = dq_s.transpose(0, 1).to(q.dtype)
            dk[start:end] = _sum_head_groups(dk_s, n_kv).transpose(0, 1).to(k.dtype)
            dv[start:end] = _sum_head_groups(dv_s, n_kv).transpose(0, 1).to(v.dtype)
        return dq, dk, dv, None, None, None, None, None


def fused_attention_backward_supported(q: torch.Tensor) -> bool:
    """The Triton backward runs: tensor-core dtype on a GPU, and a head dim it has a config for."""
    if not on_tensor_cores(q):
        return False
    from spirl_kernels.attention_backward import CONFIGS

    return q.shape[-1] in CONFIGS


def attention(q, k, v, cu_seqlens, max_seqlen: int, scale: float, backend, block: int = DEFAULT_BLOCK):
    """Causal varlen attention; returns out [T, Hq, D]. `block` is the backward's query-block
    size (the forward's tiling is the backend's own)."""
    if not _needs_grad(q, k, v):
        return backend.attention(q, k, v, cu_seqlens, max_seqlen, scale)[0]
    return AttentionFunction.apply(q, k, v, cu_seqlens, max_seqlen, scale, backend, block)


# --------------------------------------------------------------------------------------------
# Token log-probabilities (the sampler's logprob op)
# --------------------------------------------------------------------------------------------


class TokenLogprobsFunction(torch.autograd.Function):
    """lp = backend.token_logprobs(z, ids): float32 [T], lp_t = log softmax(z_t)[ids_t], z [T, V].

    Forward (the backend's kernel, e.g. vLLM's sampler kernel):
        lp_t = z_t[ids_t] - max(z_t) - log(sum_j exp(z_tj - max(z_t)))
    Backward, with p_t = softmax(z_t) recomputed in float32 (float64 for float64 logits):
        dz_tj = g_t * ([j == ids_t] - p_tj)
    cast to z's dtype.
    """

    @staticmethod
    def forward(ctx, logits, ids, backend):
        ctx.save_for_backward(logits, ids)
        return backend.token_logprobs(logits, ids)

    @staticmethod
    def backward(ctx, grad_out):
        logits, ids = ctx.saved_tensors
        cdt = compute_dtype(logits.dtype)
        dz = torch.softmax(logits.to(cdt), dim=-1).neg_()
        dz.scatter_add_(-1, ids[:, None], torch.ones_like(ids[:, None], dtype=cdt))  # one index per row
        return (dz * grad_out.to(cdt)[:, None]).to(logits.dtype), None, None


def token_logprobs(logits, ids, backend):
    """log softmax(logits)[t, ids[t]] for each row t, in float32 (float64 for float64 logits)."""
    if not _needs_grad(logits):
        return backend.token_logprobs(logits, ids)
    return TokenLogprobsFunction.apply(logits, ids, backend)


# --------------------------------------------------------------------------------------------
# lm_head + sampling transform + token log-probabilities, fused and chunked over rows
# --------------------------------------------------------------------------------------------

LOGITS_CHUNK_ELEMENTS = 1 << 28
"""Logit elements per chunk of rows (bf16: 512 MiB; ~1770 rows at Qwen3's vocabulary): bounds the
[rows, vocab] temporaries of lm_head_logprobs. Each row's numbers do not depend on the chunking (every op is row-wise)."""


def _row_chunks(n_rows: int, vocab: int) -> list[slice]:
    step = max(1, LOGITS_CHUNK_ELEMENTS // vocab)
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def _log_softmax_and_probs(z: torch.Tensor):
    """(log p, p) of softmax(z) in the compute dtype. Written with logsumexp rather than aten
    log_softmax (which vLLM's batch-invariant mode reroutes to a slower Triton kernel)."""
    zf = z.to(compute_dtype(z.dtype))
    logp = zf - torch.logsumexp(zf, dim=-1, keepdim=True)
    return logp, logp.exp()


def _entropy(logp: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """-sum_j p_j log p_j per row; entries with p = 0 (min-p's -inf logits) contribute 0."""
    return -torch.where(p > 0, p * logp, 0.0).sum(-1)


def _chunk_forward(h, weight, ids, temperature, min_p, backend):
    return backend.sampling_logits(backend.linear(h, weight), temperature, min_p)


def _entropy_of(z: torch.Tensor) -> torch.Tensor:
    """Entropy per row of softmax(z): one Triton pass per row on a GPU (row-wise, so the same bits
    whatever the chunking), PyTorch elsewhere."""
    if on_tensor_cores(z):
        from spirl_kernels.logprob_backward import entropy

        return entropy(z)
    return _entropy(*_log_softmax_and_probs(z))


def _lm_head_logprobs_forward(h, weight, ids, temperature, min_p, want_entropy, backend):
    lps, ents = [], []
    for sl in _row_chunks(h.shape[0], weight.shape[0]):
        z = _chunk_forward(h[sl], weight, ids[sl], temperature, min_p, backend)
        lps.append(backend.token_logprobs(z, ids[sl]))
        if want_entropy:
            ents.append(_entropy_of(z))
    lp = torch.cat(lps) if lps else h.new_empty(0, dtype=torch.float32)
    ent = (torch.cat(ents) if ents else lp.new_empty(0)) if want_entropy else None
    return lp, ent


class LMHeadLogprobsFunction(torch.autograd.Function):
    """(lp, H) = log-probabilities of `ids` (and entropies) under the sampling distribution,
    straight from the final hidden states h [N, K] and lm_head W [V, K], in chunks of rows.

    Forward, per chunk c (every op the backend's, so lp is bitwise what the sampler reports):
        logits_c = backend.linear(h_c, W)                      [rows, V], activation dtype
        z_c      = backend.sampling_logits(logits_c, T, min_p)  logits / T, then min-p
        lp_c     = backend.token_logprobs(z_c, ids_c)          float32
        H_c      = -sum_j p_j log p_j,  p = softmax(z_c)        float32 (when asked for)
    Only h, W and ids are saved: the backward recomputes each chunk, so no [N, V] tensor ever
    exists (at 16k rows x 152k vocab that would be 10 GB in float32).
    Backward, per chunk, with incoming gradients g (of lp) and e (of H), in float32:
        log p = z - logsumexp(z),  p = exp(log p)
        dz = g * (onehot(ids) - p) - e * p * (log p + H)    (entries with p = 0 get 0)
        dlogits = dz / T      (the temperature's derivative; min-p's mask is piecewise constant
                               and the bf16 rounding of z is passed straight through)
        dh_c = dlogits W,   dW += dlogits^T h_c
    The GEMMs are tensor-core GEMMs on a GPU (`_mm`); dW is accumulated in float32 over the
    chunks in chunk order and rounded once to W's dtype.
    A LoRA head (W merged from a frozen base and s B A; `lora_scale`, `lora_a`, `lora_b` given):
    instead of dW, per chunk dB += s dlogits^T (h_c A^T) and dA += s (dlogits B)^T h_c
    (LoRALinearFunction's math), accumulated in float32 in chunk order.
    """

    @staticmethod
    def forward(ctx, h, weight, ids, temperature, min_p, want_entropy, backend, lora_scale=None, lora_a=None,
                lora_b=None):
        lp, ent = _lm_head_logprobs_forward(h, weight, ids, temperature, min_p, want_entropy, backend)
        ctx.save_for_backward(h, weight, ids, lora_a, lora_b)
        ctx.temperature, ctx.min_p, ctx.backend, ctx.lora_scale = temperature, min_p, backend, lora_scale
        ctx.set_materialize_grads(False)  # an unused output (the entropy of a metric) costs nothing
        if ent is None:
            return lp
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent=None):
        h, weight, ids, lora_a, lora_b = ctx.saved_tensors
        cdt = compute_dtype(h.dtype)
        need = ctx.needs_input_grad
        dh = torch.empty_like(h) if need[0] else None
        dw = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need[1] else None
        lora = None
        if lora_a is not None and (need[8] or need[9]):  # [dA, dB] summed over chunks in float32 (float64 on float64)
            acc = torch.float64 if cdt == torch.float64 else torch.float32
            lora = [torch.zeros(t.shape, dtype=acc, device=t.device) if wanted else None
                    for t, wanted in ((lora_a, need[8]), (lora_b, need[9]))]
        for sl in _row_chunks(h.shape[0], weight.shape[0]):
            z = _chunk_forward(h[sl], weight, ids[sl], ctx.temperature, ctx.min_p, ctx.backend)
            if on_tensor_cores(z):  # the same math in one Triton pass per row
                from spirl_kernels.logprob_backward import logprob_backward

                dlogits = logprob_backward(z, ids[sl], None if grad_lp is None else grad_lp[sl],
                                           None if grad_ent is None else grad_ent[sl], 1.0 / ctx.temperature)
                _accumulate_lm_head_grads(dlogits, h, weight, sl, dh, dw, lora, lora_a, lora_b, ctx.lora_scale)
                continue
            logp, p = _log_softmax_and_probs(z)
            if grad_lp is None:
                dz = torch.zeros_like(p)
            else:
                dz = p * (-grad_lp[sl].to(cdt))[:, None]
                dz.scatter_add_(-1, ids[sl, None], grad_lp[sl, None].to(cdt))  # one index per row
            if grad_ent is not None:
                ent = _entropy(logp, p)
                dz -= grad_ent[sl].to(cdt)[:, None] * torch.where(p > 0, p * (logp + ent[:, None]), 0.0)
            if ctx.temperature != 1.0:
                dz /= ctx.temperature
            _accumulate_lm_head_grads(dz.to(h.dtype), h, weight, sl, dh, dw, lora, lora_a, lora_b, ctx.lora_scale)
        da, db = (None, None) if lora is None else (None if g is None else g.to(t.dtype)
                                                    for g, t in zip(lora, (lora_a, lora_b)))
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None, None, None, None, da, db


def _accumulate_lm_head_grads(dlogits, h, weight, sl, dh, dw, lora=None, lora_a=None, lora_b=None,
                              scale=None) -> None:
    """dh[sl] = dlogits W;  dw += dlogits^T h[sl] (float32); for a LoRA head, [dA, dB] += the
    adapter's low-rank gradients (`_lora_grads`) instead; for one chunk of rows."""
    if dh is not None:
        dh[sl] = _mm(dlogits, weight, h.dtype)
    if dw is not None:
        dw += _mm(dlogits.t(), h[sl], dw.dtype)
    if lora is not None:
        da, db = _lora_grads(dlogits, h[sl], lora_a, lora_b, scale, lora[0] is not None, lora[1] is not None)
        for acc, g in zip(lora, (da, db)):
            if acc is not None:
                acc += g.to(acc.dtype)


def lm_head_logprobs(h, weight, ids, backend, temperature: float = 1.0, min_p: float = 0.0,
                     entropy: bool = False, lora=None):
    """float32 log-probabilities [N] of ids [N] under softmax(sampling_logits(h W^T)), and the
    entropies [N] of those distributions when `entropy` (else None). See LMHeadLogprobsFunction.
    `lora` = (A, B, scale) when W is a merged LoRA head: then A and B get the gradients
    (`_lora_grads`, summed over the row chunks in order) and W none."""
    a, b, scale = lora if lora is not None else (None, None, None)
    if not _needs_grad(h, weight, *(t for t in (a, b) if t is not None)):
        return _lm_head_logprobs_forward(h, weight, ids, temperature, min_p, entropy, backend)
    out = LMHeadLogprobsFunction.apply(h, weight, ids, temperature, min_p, entropy, backend, scale, a, b)
    return out if entropy else (out, None)
