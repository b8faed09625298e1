"""Causal attention over variable-length packed sequences, in plain PyTorch.

Layout (the same as flash-attention's varlen API and vLLM's flat token batch):
    q: [T, Hq, D], k/v: [T, Hk, D] with Hq % Hk == 0 (GQA: query head h reads kv head h // (Hq/Hk))
    cu_seqlens: int32 [B+1], sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]
    out: [T, Hq, D] (dtype of q), lse: float32/float64 [Hq, T], the log-sum-exp of each score row.

The S x S score matrix is never built: queries are processed in blocks of `block` rows, each
against the keys it may see (a [Hq, block, S] slab), so memory is O(block * S) per sequence.
Each block sees its complete key row, so the softmax is exact (no online rescaling needed).
The backward in `batch_invariant_backward.py` walks the same blocks.
"""

from __future__ import annotations

import torch

from batch_invariant_backward import DEFAULT_BLOCK, causal_block_scores, compute_dtype, expand_kv, iter_sequences


def varlen_causal_attention(q, k, v, cu_seqlens, scale: float, block: int = DEFAULT_BLOCK):
    """Reference forward: returns (out [T, Hq, D] in q.dtype, lse [Hq, T] in the compute dtype)."""
    cdt = compute_dtype(q.dtype)
    n_rep = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=cdt, device=q.device)
    for start, end in iter_sequences(cu_seqlens):
        qs = q[start:end].transpose(0, 1).to(cdt)  # [Hq, L, D]
        ks = expand_kv(k[start:end].transpose(0, 1).to(cdt), n_rep)
        vs = expand_kv(v[start:end].transpose(0, 1).to(cdt), n_rep)
        for i0 in range(0, end - start, block):
            i1 = min(i0 + block, end - start)
            scores = causal_block_scores(qs[:, i0:i1], ks[:, :i1], i0, scale)
            row_lse = torch.logsumexp(scores, dim=-1)  # [Hq, Bq]
            probs = torch.exp(scores - row_lse[..., None])
            out[start + i0:start + i1] = torch.matmul(probs, vs[:, :i1]).transpose(0, 1).to(q.dtype)
            lse[:, start + i0:start + i1] = row_lse
    return out, lse
