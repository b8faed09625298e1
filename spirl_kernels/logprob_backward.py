"""Entropy and the backward of token log-probabilities over the vocabulary, one Triton program per row.

    z [R, V]  the sampling distribution's logits (bf16, -inf where min-p cut), one row per token
    p = softmax(z), log p = z - lse, lse = log sum_j exp(z_j)
    H = -sum_j p_j log p_j = lse - sum_j p_j z_j                    (terms with p_j = 0 are 0)

`entropy(z)` returns H [R] (fp32). `logprob_backward(z, ids, g, e, scale)` returns the gradient
with respect to the *raw* logits of  sum_r g_r log p_r(ids_r) + e_r H_r  when z = raw / T
(scale = 1 / T), in z's dtype:
    dz_j = g (1[j = id] - p_j) - e p_j (log p_j + H),   d raw_j = dz_j * scale

Per row, pass 1 streams the vocabulary once keeping a running max m, s = sum exp(z - m) and
t = sum exp(z - m) z (both rescaled when m grows), so lse = m + log s and sum_j p_j z_j = t / s;
pass 2 writes dz. Everything is fp32 in registers: one read of z (two for the backward) and one
write, where the PyTorch form made ~10 passes over float32 copies. A row's result depends only on
that row (chunking the rows changes no bit) and its reduction order only on V, so it is
deterministic.

`_logprob_bwd_kernel` does not specialize on the alignment of its per-row inputs (ids, g, e: one
scalar load per program, nothing to vectorize): the trainer passes slices of them per chunk of rows
(batch_invariant_backward._row_chunks, 1,766 rows at Qwen3's vocabulary), and a chunk starting at a
row that is not a multiple of 4 would otherwise build a second variant of the kernel in the middle
of step 1 (seen on an H100 on 2026-11-26, after `--precompile 1` had built the first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _row_stats(Z_row, V, BLOCK: tl.constexpr):
    """(lse, entropy) of one row."""
    m = float("-inf")
    s = 0.0
    t = 0.0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(Z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        live = z > float("-inf")
        e = tl.where(live, tl.exp(z - m_new), 0.0)
        alpha = tl.where(m > float("-inf"), tl.exp(m - m_new), 0.0)
        s = s * alpha + tl.sum(e, axis=0)
        t = t * alpha + tl.sum(tl.where(live, e * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    return lse, lse - t / s


@triton.jit
def _entropy_kernel(Z, H_OUT, V, szr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _, ent = _row_stats(Z + row * szr, V, BLOCK)
    tl.store(H_OUT + row, ent)


@triton.jit(do_not_specialize=["IDS", "G", "E"])
def _logprob_bwd_kernel(Z, IDS, G, E, DZ, V, szr, sdr, scale,
                        HAS_G: tl.constexpr, HAS_E: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * szr
    lse, ent = _row_stats(z_row, V, BLOCK)
    g = tl.load(G + row) if HAS_G else 0.0
    e = tl.load(E + row) if HAS_E else 0.0
    target = tl.load(IDS + row)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        live = z > float("-inf")
        logp = z - lse
        p = tl.where(live, tl.exp(logp), 0.0)
        dz = tl.where(cols == target, g, 0.0) - g * p
        dz -= tl.where(live, e * p * (logp + ent), 0.0)
        tl.store(DZ + row * sdr + cols, (dz * scale).to(DZ.dtype.element_ty), mask=cols < V)


def _rows(z: torch.Tensor) -> torch.Tensor:
    return z if z.stride(-1) == 1 else z.contiguous()


def entropy(z: torch.Tensor) -> torch.Tensor:
    """H [R] fp32 of softmax(z) per row of z [R, V]."""
    z = _rows(z)
    out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[0]:
        _entropy_kernel[(z.shape[0],)](z, out, z.shape[1], z.stride(0), BLOCK=BLOCK_V, num_warps=8)
    return out


def logprob_backward(z: torch.Tensor, ids: torch.Tensor, grad_lp: torch.Tensor | None,
                     grad_ent: torch.Tensor | None, scale: float) -> torch.Tensor:
    """d/d raw logits [R, V] (z's dtype) of sum g log p(ids) + e H, with z = raw * scale."""
    z = _rows(z)
    dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    if z.shape[0]:
        dummy = torch.empty(1, dtype=torch.float32, device=z.device)
        g = dummy if grad_lp is None else grad_lp.float().contiguous()
        e = dummy if grad_ent is None else grad_ent.float().contiguous()
        _logprob_bwd_kernel[(z.shape[0],)](z, ids.contiguous(), g, e, dz, z.shape[1], z.stride(0), dz.stride(0),
                                           float(scale), HAS_G=grad_lp is not None, HAS_E=grad_ent is not None,
                                           BLOCK=BLOCK_V, num_warps=8)
    return dz
