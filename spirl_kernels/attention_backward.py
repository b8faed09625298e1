"""Deterministic backward of causal varlen attention, in Triton (FlashAttention-2's two-pass split).

Layout (flash-attention's varlen API, the forward's own):
    q [T, Hq, D], k/v [T, Hk, D]  bf16 or fp16, Hq % Hk == 0: query head h reads kv head h // G,
                                  G = Hq / Hk (GQA group size)
    out, dout [T, Hq, D]          the forward's output and its incoming gradient
    lse [Hq, T] float32           natural-log log-sum-exp of each row of scaled scores
    cu_seqlens int32 [B+1]        sequence b is rows cu_seqlens[b] : cu_seqlens[b+1]

Math, per sequence and query head (Q, dO, O: [L, D] rows of the sequence; K, V: the kv head's):
    S  = scale * Q K^T, future keys masked (key j visible to query i iff j <= i)
    P  = exp(S - lse)                          recomputed from the saved lse, never stored
    dV = P^T dO                                (summed over the G query heads of a kv head)
    dP = dO V^T
    Delta_i = sum_d dO_id O_id = rowsum(dO * O)  (= rowsum(P * dP), the softmax Jacobian term)
    dS = P * (dP - Delta)
    dQ = scale * dS K
    dK = scale * dS^T Q                        (summed over the G query heads of a kv head)
P is computed as exp2(S * log2(e) - lse * log2(e)) (one FMA and MUFU.EX2 per element); every other
step is plain fp32 arithmetic, no approximations. The four products run on tensor cores (tl.dot) with bf16/fp16
operands and fp32 accumulation; P and dS are rounded to the input dtype before their products (as
in every flash backward), so the gradients carry a relative error of a few 1e-3 of their norm
against a float32 reference. Outputs are rounded once to the input dtype.

Three kernels, no atomics:
  1. `_preprocess_kernel`, one program per (block of rows, query head): Delta [Hq, T] in fp32
     (each row one reduction over D), and zeros for rows outside every sequence (rows before
     cu_seqlens[0] or from cu_seqlens[B] on), so every element of dq/dk/dv is written by someone.
  2. `_dkdv_kernel`, one program per (kv block of BLOCK_N1 rows, kv head, sequence): holds its
     K, V tile and fp32 dK, dV accumulators in the SM and walks, for each of the G query heads of
     its group in order, the query blocks of BLOCK_M1 rows that can see it: first the blocks that
     straddle the diagonal (rows n0 .. n0+BLOCK_N1, causal mask applied), then the fully visible
     blocks below, in increasing row order. dK and dV are stored once, by their only owner.
  3. `_dq_kernel`, one program per (query block of BLOCK_M2 rows, query head, sequence): holds
     Q, dO, lse, Delta and an fp32 dQ accumulator, and walks the kv blocks of BLOCK_N2 rows it can
     see: the fully visible ones 0 .. m0 in increasing order, then the diagonal ones (masked).
     It recomputes P and dP (FlashAttention-2's deterministic split costs 7 matmuls per tile
     instead of 5; the alternative, dQ accumulated across kv-block programs, needs atomics whose
     order - and so whose floating-point sum - changes from run to run).
Fully masked tiles (query block entirely above the diagonal) are never visited.

Determinism: every output element has exactly one writer, and the value it writes is a chain of
fp32 tensor-core accumulations and elementwise ops whose order is fixed by the loop structure -
heads in group order, blocks in increasing order - and the compile-time config. Nothing depends
on scheduling, so two runs give the same bits.

Batch invariance: the grid is (max blocks, heads, sequences) with early exit; each program finds
its sequence's start and length in cu_seqlens and indexes rows relative to that start. Blocks are
aligned to the sequence's first row, the loop bounds are functions of the sequence's own length
L, rows past L are loaded as zeros (lse as +inf, so their P is exactly 0 and they contribute
exactly nothing), and reductions are over that sequence only. The preprocess blocks rows by
position in the packed batch, but Delta's reduction is the same whichever block a row falls in:
each row of a [rows, D] tile is spread over the threads identically. So a sequence's gradients are
bitwise the same alone or packed among any others, at any offset. The config is keyed by head
dimension only (never by lengths, batch size or max_seqlen): a different tile shape would change
the accumulation order and so the bits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
"""log2(e): P = exp(S - lse) is computed as exp2(S * log2(e) - lse * log2(e))."""


@dataclass(frozen=True)
class AttentionBwdConfig:
    """Tile shapes and launch parameters of the two main kernels.

    dK/dV kernel: owns BLOCK_N1 kv rows, steps over query rows BLOCK_M1 at a time.
    dQ kernel:    owns BLOCK_M2 query rows, steps over kv rows BLOCK_N2 at a time.
    BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0, so the diagonal-straddling steps are
    whole blocks and every other step needs no causal mask.
    """

    block_m1: int
    block_n1: int
    warps1: int
    stages1: int
    block_m2: int
    block_n2: int
    warps2: int
    stages2: int

    def __post_init__(self):
        if self.block_n1 % self.block_m1 or self.block_m2 % self.block_n2:
            raise ValueError(f"need block_n1 % block_m1 == 0 and block_m2 % block_n2 == 0: {self}")
        for b in (self.block_m1, self.block_n1, self.block_m2, self.block_n2):
            if b < 16 or b & (b - 1):
                raise ValueError(f"block sizes must be powers of two >= 16 (tl.dot): {self}")


CONFIGS: dict[int, AttentionBwdConfig] = {
    # sm_90 (H100). 128 kv rows per dK/dV program (each Q/dO tile loaded feeds 128 kv rows) and 128
    # query rows per dQ program, 8 warps (two wgmma warpgroups of 64 rows). The dK/dV program
    # keeps two fp32 [128, D] accumulators in registers (128 per thread at D = 128), so its query
    # step is what fits beside them: compiled for sm_90 (Triton 3.9, ptxas), BLOCK_M1 = 64 at
    # D = 128 spills inside the inner loop, 32 does not; at D = 64, 64 fits. Retune with
    # `compare/bench_attention_backward.py --sweep` (`git show 6396e11:compare/bench_attention_backward.py`).
    64: AttentionBwdConfig(block_m1=64, block_n1=128, warps1=8, stages1=2,
                           block_m2=128, block_n2=64, warps2=8, stages2=3),
    128: AttentionBwdConfig(block_m1=32, block_n1=128, warps1=8, stages1=2,
                            block_m2=128, block_n2=64, warps2=8, stages2=2),
}
"""The config per head dimension. Keyed by D only: the result's bits depend on the config."""

PREPROCESS_ELEMS = 4096
"""Rows per preprocess program: PREPROCESS_ELEMS // D (32 fp32 elements of O and of dO per thread
at 4 warps: a memory-bound kernel that must not spill)."""


# --------------------------------------------------------------------------------------------
# 1. Delta = rowsum(dO * O), zeros for rows outside every sequence
# --------------------------------------------------------------------------------------------


@triton.jit
def _preprocess_kernel(O, DO, DELTA, DQ, DK, DV, CU, T, n_seqs, n_kv_heads,
                       stride_ot, stride_oh, stride_dot, stride_doh,
                       stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                       HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_t < T
    rows = offs_t.to(tl.int64)
    o = tl.load(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                mask=in_range[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :],
                 mask=in_range[:, None], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(DELTA + h.to(tl.int64) * T + rows, delta, mask=in_range)

    first = tl.load(CU)
    last = tl.load(CU + n_seqs)
    outside = in_range & ((offs_t < first) | (offs_t >= last))
    zeros = tl.zeros([BLOCK_T, HEAD_DIM], dtype=DQ.dtype.element_ty)
    tl.store(DQ + rows[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :], zeros,
             mask=outside[:, None])
    if h < n_kv_heads:
        tl.store(DK + rows[:, None] * stride_dkt + h * stride_dkh + offs_d[None, :], zeros,
                 mask=outside[:, None])
        tl.store(DV + rows[:, None] * stride_dvt + h * stride_dvh + offs_d[None, :], zeros,
                 mask=outside[:, None])


# --------------------------------------------------------------------------------------------
# 2. dK, dV: one program per (kv block, kv head, sequence)
# --------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_steps(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                stride_qt, stride_dot, stride_lt, qk_scale, seq_len, offs_n, m_begin, num_steps,
                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL_MASK: tl.constexpr):
    """num_steps query blocks of BLOCK_M rows from row m_begin (sequence-relative), in order.
    Works on transposed tiles ([kv rows, query rows]) so dK, dV accumulate without transposes."""
    offs_d = tl.arange(0, HEAD_DIM)
    for i in range(num_steps):
        offs_m = m_begin + i * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seq_len
        q_t = tl.load(q_base + offs_m[None, :] * stride_qt + offs_d[:, None],
                      mask=row_ok[None, :], other=0.0)                              # [D, BM]
        # rows past the sequence: lse = +inf makes their P exactly 0 (and their dO, Delta are 0)
        lse2 = tl.load(lse_base + offs_m * stride_lt, mask=row_ok, other=float("inf")) * LOG2E
        s_t = tl.dot(k, q_t)                                                        # [BN, BM]
        p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        if CAUSAL_MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :],
                     mask=row_ok[:, None], other=0.0)                               # [BM, D]
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        dp_t = tl.dot(v, tl.trans(do))                                              # [BN, BM]
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), dk)
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, sm_scale, T,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_dot, stride_doh, stride_lh, stride_lt,
                 stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_start = tl.load(CU + seq)
    seq_len = tl.load(CU + seq + 1) - seq_start
    n0 = pid_n * BLOCK_N
    if n0 >= seq_len:
        return
    start = seq_start.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < seq_len
    k = tl.load(K + start * stride_kt + kv_head * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(V + start * stride_vt + kv_head * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    # query blocks crossing the diagonal (rows n0 .. n0 + BLOCK_N), then the fully visible ones
    diag_steps = tl.cdiv(tl.minimum(seq_len - n0, BLOCK_N), BLOCK_M)
    full_steps = tl.cdiv(tl.maximum(seq_len - n0 - BLOCK_N, 0), BLOCK_M)
    for g in range(GROUP):
        h = kv_head * GROUP + g
        q_base = Q + start * stride_qt + h * stride_qh
        do_base = DO + start * stride_dot + h * stride_doh
        lse_base = LSE + h.to(tl.int64) * stride_lh + start * stride_lt
        delta_base = DELTA + h.to(tl.int64) * T + start
        dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                             stride_qt, stride_dot, stride_lt, qk_scale, seq_len, offs_n,
                             n0, diag_steps, BLOCK_M, HEAD_DIM, CAUSAL_MASK=True)
        dk, dv = _dkdv_steps(dk, dv, k, v, q_base, do_base, lse_base, delta_base,
                             stride_qt, stride_dot, stride_lt, qk_scale, seq_len, offs_n,
                             n0 + BLOCK_N, full_steps, BLOCK_M, HEAD_DIM, CAUSAL_MASK=False)
    dk = dk * sm_scale
    tl.store(DK + start * stride_dkt + kv_head * stride_dkh + offs_n[:, None] * stride_dkt + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + start * stride_dvt + kv_head * stride_dvh + offs_n[:, None] * stride_dvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


# --------------------------------------------------------------------------------------------
# 3. dQ: one program per (query block, query head, sequence)
# --------------------------------------------------------------------------------------------


@triton.jit
def _dq_steps(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, qk_scale, seq_len,
              offs_m, n_begin, num_steps,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL_MASK: tl.constexpr):
    """num_steps kv blocks of BLOCK_N rows from row n_begin (sequence-relative), in order."""
    offs_d = tl.arange(0, HEAD_DIM)
    for i in range(num_steps):
        offs_n = n_begin + i * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < seq_len
        k_t = tl.load(k_base + offs_n[None, :] * stride_kt + offs_d[:, None],
                      mask=col_ok[None, :], other=0.0)                              # [D, BN]
        v_t = tl.load(v_base + offs_n[None, :] * stride_vt + offs_d[:, None],
                      mask=col_ok[None, :], other=0.0)                              # [D, BN]
        s = tl.dot(q, k_t)                                                          # [BM, BN]
        p = tl.exp2(s * qk_scale - lse2[:, None])
        if CAUSAL_MASK:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = tl.dot(do, v_t)                                                        # [BM, BN]
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU, sm_scale, T,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_dot, stride_doh, stride_lh, stride_lt, stride_dqt, stride_dqh,
               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # the last query blocks have the most kv blocks to visit: launch them first
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2)
    seq_start = tl.load(CU + seq)
    seq_len = tl.load(CU + seq + 1) - seq_start
    m0 = pid_m * BLOCK_M
    if m0 >= seq_len:
        return
    start = seq_start.to(tl.int64)
    kv_head = h // GROUP
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q = tl.load(Q + start * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + start * stride_dot + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE + h.to(tl.int64) * stride_lh + (start + offs_m) * stride_lt,
                   mask=row_ok, other=float("inf")) * LOG2E
    delta = tl.load(DELTA + h.to(tl.int64) * T + start + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * LOG2E
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh
    # kv blocks fully below the diagonal (rows 0 .. m0), then the ones crossing it
    dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, qk_scale, seq_len,
                   offs_m, 0, m0 // BLOCK_N, BLOCK_N, HEAD_DIM, CAUSAL_MASK=False)
    diag_steps = tl.cdiv(tl.minimum(seq_len - m0, BLOCK_M), BLOCK_N)
    dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, qk_scale, seq_len,
                   offs_m, m0, diag_steps, BLOCK_N, HEAD_DIM, CAUSAL_MASK=True)
    dq = dq * sm_scale
    tl.store(DQ + start * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Any strides are fine for the token and head dims; the head dim must be unit-stride."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_out(name: str, buf, like: torch.Tensor) -> torch.Tensor:
    if buf is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    if buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device or buf.stride(-1) != 1:
        raise ValueError(f"{name}: need shape {tuple(like.shape)}, dtype {like.dtype}, device {like.device} "
                         f"and a unit-stride last dim, got {tuple(buf.shape)} {buf.dtype} {buf.device} "
                         f"strides {buf.stride()}")
    return buf


def attention_backward(q, k, v, out, dout, lse, cu_seqlens, max_seqlen: int, scale: float, *,
                       config: AttentionBwdConfig | None = None, dq=None, dk=None, dv=None):
    """Gradients (dq, dk, dv) of causal varlen attention; see the module docstring.

    q [T, Hq, D], k/v [T, Hk, D] (bf16 or fp16, any strides with a unit-stride last dim, else they
    are copied), out/dout [T, Hq, D], lse [Hq, T] float32 (natural log), cu_seqlens int32 [B+1],
    max_seqlen >= the longest sequence (it sizes the grid; a smaller value silently drops rows).
    dq/dk/dv: optional preallocated outputs (written completely). `config` overrides the per-head-
    dim table (`CONFIGS`) - for tuning only, since it changes the result's bits.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v must be [T, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    total, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    if k.shape != (total, n_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k, v must be [T, Hk, D] = [{total}, Hk, {head_dim}]; got {tuple(k.shape)}, {tuple(v.shape)}")
    if out.shape != q.shape or dout.shape != q.shape:
        raise ValueError(f"out, dout must match q {tuple(q.shape)}; got {tuple(out.shape)}, {tuple(dout.shape)}")
    if n_q_heads % n_kv_heads:
        raise ValueError(f"query heads ({n_q_heads}) must be a multiple of kv heads ({n_kv_heads})")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype, bfloat16 or float16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if config is None:
        if head_dim not in CONFIGS:
            raise ValueError(f"head_dim {head_dim} is not supported (supported: {sorted(CONFIGS)})")
        config = CONFIGS[head_dim]
    if lse.shape != (n_q_heads, total) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 [Hq, T] = [{n_q_heads}, {total}]; got {lse.dtype} {tuple(lse.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be [B+1] with B >= 1; got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int32:
        cu_seqlens = cu_seqlens.to(torch.int32)
    cu_seqlens = cu_seqlens.contiguous()
    n_seqs = cu_seqlens.numel() - 1
    if n_seqs > 65535:
        raise ValueError(f"at most 65535 sequences per call (the grid's z dimension); got {n_seqs}")

    q, k, v, out, dout = (_last_dim_contiguous(x) for x in (q, k, v, out, dout))
    dq, dk, dv = _check_out("dq", dq, q), _check_out("dk", dk, k), _check_out("dv", dv, v)
    group = n_q_heads // n_kv_heads
    max_seqlen = int(max_seqlen)
    if total == 0:
        return dq, dk, dv
    delta = torch.empty(n_q_heads, total, dtype=torch.float32, device=q.device)

    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        block_t = max(16, PREPROCESS_ELEMS // head_dim)
        _preprocess_kernel[(triton.cdiv(total, block_t), n_q_heads)](
            out, dout, delta, dq, dk, dv, cu_seqlens, total, n_seqs, n_kv_heads,
            out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
            dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            HEAD_DIM=head_dim, BLOCK_T=block_t, num_warps=4)
        if max_seqlen <= 0:
            return dq, dk, dv
        common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  dout.stride(0), dout.stride(1), lse.stride(0), lse.stride(1))
        _dkdv_kernel[(triton.cdiv(max_seqlen, config.block_n1), n_kv_heads, n_seqs)](
            q, k, v, dout, lse, delta, dk, dv, cu_seqlens, float(scale), total, *common,
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config.block_m1, BLOCK_N=config.block_n1,
            num_warps=config.warps1, num_stages=config.stages1)
        _dq_kernel[(triton.cdiv(max_seqlen, config.block_m2), n_q_heads, n_seqs)](
            q, k, v, dout, lse, delta, dq, cu_seqlens, float(scale), total, *common,
            dq.stride(0), dq.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config.block_m2, BLOCK_N=config.block_n2,
            num_warps=config.warps2, num_stages=config.stages2)
    return dq, dk, dv

