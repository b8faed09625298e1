"""Qwen3's per-head q/k RMSNorm and neox rotary as one Triton pass, with vLLM's bits.

vLLM 0.26 (batch-invariant mode) runs, per layer: q and k are column slices of the qkv GEMM's
output; each is copied contiguous and normalized by `rms_norm_batch_invariant` (Triton
`_rms_norm_kernel`, one program per head row), then `torch.ops._C.rotary_embedding` rotates them
in place. The trainer ran the same ops, plus copies so the in-place rotary never mutates autograd
inputs: 7 kernels per layer, 12 % of the forward's GPU time at 8 x 1024 tokens of Qwen3-1.7B
(torch.profiler, H100). This kernel reads q or k straight from the qkv output and writes the
normalized, rotated heads contiguous, once:

  * Sum of squares: the code of vLLM's `_rms_norm_kernel`, unchanged - a 1024-wide masked block,
    `tl.sum`, launched with the same (default) warps. The squares of bf16 values are exact in
    fp32, so the reduction tree is the only thing that fixes the sum's bits, and identical code
    over an identically shaped block compiles to the identical tree.
  * Normalization, elementwise as vLLM's second loop: (x * inv_rms) * w in fp32, rounded to the
    activation dtype.
  * Rotation, as vLLM 0.26's CUDA kernel: x1 c - x2 s and x2 c + x1 s in fp32 from the rounded
    values and the activation-dtype cache, rounded once. Both products of 8-bit mantissas are exact
    in fp32, so a fused multiply-add gives the same bits as separate ones.

`tests/gpu/test_ops_vs_vllm.py` proves the output equal to vLLM's two ops, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

VLLM_NORM_BLOCK = 1024
"""`rms_norm_batch_invariant`'s BLOCK_SIZE: the reduction's block shape, hence its bits."""


@triton.jit
def _norm_rope_kernel(input_ptr, weight_ptr, pos_ptr, cache_ptr, output_ptr, stride_t, stride_h,
                      n_heads, n_cols, eps, cache_stride, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr):
    row_idx = tl.program_id(0).to(tl.int64)  # one (token, head) row, as vLLM's norm runs them
    t = row_idx // n_heads
    row_start_ptr = input_ptr + t * stride_t + (row_idx % n_heads) * stride_h

    # vLLM's _rms_norm_kernel, step 1 and 2, verbatim
    sum_sq = tl.zeros([1], dtype=tl.float32)
    for col_offset in range(0, n_cols, BLOCK_SIZE):
        col_idx = col_offset + tl.arange(0, BLOCK_SIZE)
        mask = col_idx < n_cols
        vals = tl.load(row_start_ptr + col_idx, mask=mask, other=0.0)
        vals_f32 = vals.to(tl.float32)
        sq_vals = vals_f32 * vals_f32
        sum_sq += tl.sum(tl.where(mask, sq_vals, 0.0))
    mean_sq = sum_sq / n_cols
    rms = tl.sqrt(mean_sq + eps)
    inv_rms = 1.0 / rms

    # step 3 per half head (elementwise), then the neox rotation of the two halves
    d = tl.arange(0, HALF)
    dtype = output_ptr.dtype.element_ty
    x1 = ((tl.load(row_start_ptr + d).to(tl.float32) * inv_rms)
          * tl.load(weight_ptr + d).to(tl.float32)).to(dtype).to(tl.float32)
    x2 = ((tl.load(row_start_ptr + HALF + d).to(tl.float32) * inv_rms)
          * tl.load(weight_ptr + HALF + d).to(tl.float32)).to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cache_ptr + pos * cache_stride + d).to(tl.float32)
    s = tl.load(cache_ptr + pos * cache_stride + HALF + d).to(tl.float32)
    out = output_ptr + row_idx * (2 * HALF) + d
    tl.store(out, (x1 * c - x2 * s).to(dtype))
    tl.store(out + HALF, (x2 * c + x1 * s).to(dtype))


@triton.jit
def _norm_rope_rows_kernel(input_ptr, weight_ptr, pos_ptr, cache_ptr, output_ptr, stride_t, stride_h, n_rows,
                           n_heads, n_cols, eps, cache_stride, ROWS: tl.constexpr, D: tl.constexpr,
                           HALF: tl.constexpr):
    """`_norm_rope_kernel` over ROWS (token, head) rows per program, for long prefills and the
    trainer, where one 128-element row per program leaves most of the bandwidth unused (the 8B
    prefill profile: 423 ms of 8,072; docs/rollout-profile.md, fourth run).

    Same bits, because the sum of squares reduces each row with the same tree as vLLM's kernel.
    On sm_90 (PTX compared, Triton 3.6) vLLM's 1024-wide block gives each thread 8 consecutive
    elements (16-byte loads), which it sums in order (a multiply, then 7 fused multiply-adds of
    exact bf16 squares), then combines lanes by shuffles at xor distance 16, 8, 4, 2, 1 and the 4
    warps' partials. Only the first D/8 lanes of warp 0 hold a head's D values; every other term
    is an exact +0.0. Here a [ROWS, D] block gives each thread 8 consecutive elements of one row
    and D/8 lanes per row, so each row sums its 8-element runs in the same order and combines them
    at xor distance D/16, ..., 1: the same additions of the same values, without the additions of
    zero. That holds for 16-byte aligned rows (every stride a multiple of 16 elements and an
    aligned base: `fusable` checks it), the case in which vLLM's kernel gets that layout too. The
    normalization, rounding and rotation are `_norm_rope_kernel`'s elementwise code per row.
    tests/gpu/test_ops_vs_vllm.py proves both kernels equal to vLLM's ops with `torch.equal`."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    ok = r < n_rows
    r = tl.where(ok, r, 0)  # rows past the end recompute row 0 and are never stored
    t = r // n_heads
    row_start = input_ptr + t * stride_t + (r % n_heads) * stride_h

    cols = tl.arange(0, D)
    vals_f32 = tl.load(row_start[:, None] + cols[None, :]).to(tl.float32)
    sum_sq = tl.zeros([ROWS], dtype=tl.float32) + tl.sum(vals_f32 * vals_f32, axis=1)
    mean_sq = sum_sq / n_cols
    rms = tl.sqrt(mean_sq + eps)
    inv_rms = (1.0 / rms)[:, None]

    d = tl.arange(0, HALF)[None, :]
    dtype = output_ptr.dtype.element_ty
    x1 = ((tl.load(row_start[:, None] + d).to(tl.float32) * inv_rms)
          * tl.load(weight_ptr + d).to(tl.float32)).to(dtype).to(tl.float32)
    x2 = ((tl.load(row_start[:, None] + HALF + d).to(tl.float32) * inv_rms)
          * tl.load(weight_ptr + HALF + d).to(tl.float32)).to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)[:, None]
    c = tl.load(cache_ptr + pos * cache_stride + d).to(tl.float32)
    s = tl.load(cache_ptr + pos * cache_stride + HALF + d).to(tl.float32)
    out = output_ptr + r[:, None] * (2 * HALF) + d
    tl.store(out, (x1 * c - x2 * s).to(dtype), mask=ok[:, None])
    tl.store(out + HALF, (x2 * c + x1 * s).to(dtype), mask=ok[:, None])


ROWS_PER_PROGRAM = 16
"""Rows of `_norm_rope_rows_kernel`'s block (4 warps: 2-8 rows per warp at head_dim 64-256)."""

MIN_ROWS_FOR_BLOCKS = 4096
"""From this many (token, head) rows on, `norm_rope` runs the multi-row kernel (about 100 tokens of
Qwen3); decode steps keep one row per program, which spreads a few dozen rows over more SMs."""


def fusable(x: torch.Tensor, weight: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """What the kernel covers: [T, H, D] heads on CUDA in bf16/fp16, unit last stride, the cache
    [P, D] in the same dtype (full rotary: rot_dim = D), half a head a power of two, heads
    16-byte aligned (strides multiples of 16 elements, aligned base) as vLLM's contiguous q/k
    copies are: the alignment decides the reduction's layout, hence its bits."""
    d = x.shape[-1]
    half = d // 2
    return (x.is_cuda and x.dim() == 3 and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1
            and d % 2 == 0 and half & (half - 1) == 0 and d <= VLLM_NORM_BLOCK
            and weight.dtype == x.dtype and weight.shape == (d,) and weight.is_contiguous()
            and cos_sin_cache.dtype == x.dtype and cos_sin_cache.shape[-1] == d
            and cos_sin_cache.stride(-1) == 1
            and all(n == 1 or st % 16 == 0 for n, st in zip(x.shape[:2], x.stride()[:2]))
            and x.data_ptr() % 16 == 0)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
              cos_sin_cache: torch.Tensor, rows_per_program: int | None = None) -> torch.Tensor:
    """rotary(rms_norm(x) * weight) of heads x [T, H, D] (any token/head strides, e.g. a slice of
    the qkv output) at positions int64 [T]; returns a new contiguous [T, H, D].
    `rows_per_program`: 1 (one row per program) or a power of two (the multi-row kernel); by
    default chosen by the row count. Either gives the same bits."""
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    rows = rows_per_program if rows_per_program is not None else (
        ROWS_PER_PROGRAM if t * h >= MIN_ROWS_FOR_BLOCKS else 1)
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"norm_rope: rows_per_program must be 1 or a power of two, got {rows}")
    if t * h and rows > 1:
        _norm_rope_rows_kernel[(triton.cdiv(t * h, rows),)](
            x, weight, positions, cos_sin_cache, out, x.stride(0), x.stride(1), t * h, h, d, eps,
            cos_sin_cache.stride(0), ROWS=rows, D=d, HALF=d // 2)
    elif t * h:
        _norm_rope_kernel[(t * h,)](x, weight, positions, cos_sin_cache, out, x.stride(0), x.stride(1), h, d,
                                    eps, cos_sin_cache.stride(0), BLOCK_SIZE=VLLM_NORM_BLOCK, HALF=d // 2)
    return out
