"""Qwen3's per-head q/k RMSNorm and neox rotary as one Triton pass, with vLLM's bits.

vLLM 0.26 (batch-invariant mode) runs, per layer: q and k are column slices of the qkv GEMM's
output; each is copied contiguous and normalized by `rms_norm_batch_invariant` (Triton
`_rms_norm_kernel`, one program per head row), then `torch.ops._C.rotary_embedding` rotates them
in place. The trainer ran the same ops, plus copies so the in-place rotary never mutates autograd
inputs: 7 kernels per layer, 12 % of the forward's GPU time at 8 x 1024 tokens of Qwen3-1.7B
(torch.profiler, H100). This kernel reads q and k straight from the qkv output and writes the
normalized, rotated heads contiguous, once, in one launch for both (`norm_rope_qk`):

  * Sum of squares: the code of vLLM's `_rms_norm_kernel`, unchanged - a 1024-wide masked block,
    `tl.sum`, launched with the same (default) warps (`_one_row`; long inputs run blocks of rows
    with the same per-row tree, `_row_block`). The squares of bf16 values are exact in
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

from spirl_kernels.launch import cdiv, launch

VLLM_NORM_BLOCK = 1024
"""`rms_norm_batch_invariant`'s BLOCK_SIZE: the reduction's block shape, hence its bits."""


@triton.jit
def _one_row(row_idx, input_ptr, weight_ptr, pos_ptr, cache_ptr, output_ptr, stride_t, stride_h, n_heads, n_cols,
             eps, cache_stride, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr):
    """One (token, head) row, as vLLM's norm runs them (one program per row)."""
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
def _row_block(block_idx, input_ptr, weight_ptr, pos_ptr, cache_ptr, output_ptr, stride_t, stride_h, n_rows,
               n_heads, n_cols, eps, cache_stride, ROWS: tl.constexpr, HALF: tl.constexpr):
    """`_one_row` over ROWS (token, head) rows at once, for long prefills and the trainer, where one
    128-element row per program leaves most of the bandwidth unused (the 8B prefill profile: 423 ms
    of 8,072; 6396e11:docs/rollout-profile.md, fourth run).

    Same bits, because the sum of squares reduces each row with the same tree as vLLM's kernel.
    On sm_90 (PTX compared, Triton 3.6) vLLM's 1024-wide block gives each of its 4 warps' threads 8
    consecutive elements (16-byte loads), which it sums in order (a multiply, then 7 fused
    multiply-adds of exact bf16 squares), then combines lanes by shuffles at xor distance 16, 8, 4,
    2, 1 and the 4 warps' partials. Only the first D/8 lanes of warp 0 hold a head's D values;
    every other term is an exact +0.0. Here a [ROWS, D] block with ROWS * D >= 1024 gives each
    thread 8 consecutive elements of one row and D/8 lanes of one warp per row, so each row sums
    its 8-element runs in the same order and combines them at xor distance D/16, ..., 1: the same
    additions of the same values, without the additions of zero. A smaller block spreads a row
    over several warps, another tree: on an H100, ROWS 2 at D 64-256 gave other bits
    (`rows_per_program` refuses it). That holds for 16-byte aligned rows (every stride a multiple
    of 16 elements and an aligned base: `fusable` checks it), the case in which vLLM's kernel gets
    that layout too. The normalization, rounding and rotation are `_one_row`'s elementwise code."""
    r = block_idx * ROWS + tl.arange(0, ROWS).to(tl.int64)
    ok = r < n_rows
    r = tl.where(ok, r, 0)  # rows past the end recompute row 0 and are never stored
    t = r // n_heads
    row_start = input_ptr + t * stride_t + (r % n_heads) * stride_h

    cols = tl.arange(0, 2 * HALF)
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


@triton.jit
def _rows(idx, input_ptr, weight_ptr, pos_ptr, cache_ptr, output_ptr, stride_t, stride_h, n_rows, n_heads,
          n_cols, eps, cache_stride, ROWS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    if ROWS == 1:
        _one_row(idx, input_ptr, weight_ptr, pos_ptr, cache_ptr, output_ptr, stride_t, stride_h, n_heads, n_cols,
                 eps, cache_stride, BLOCK_SIZE, HALF)
    else:
        _row_block(idx, input_ptr, weight_ptr, pos_ptr, cache_ptr, output_ptr, stride_t, stride_h, n_rows,
                   n_heads, n_cols, eps, cache_stride, ROWS, HALF)


@triton.jit
def _norm_rope_kernel(a_ptr, wa_ptr, oa_ptr, a_stride_t, a_stride_h, a_heads, a_programs,
                      b_ptr, wb_ptr, ob_ptr, b_stride_t, b_stride_h, b_heads,
                      pos_ptr, cache_ptr, n_tokens, n_cols, eps, cache_stride,
                      ROWS: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Two head tensors of the same tokens (q and k) in one launch: the first `a_programs` programs
    take a's rows, the rest b's (b may have none). Each row is computed as `_rows` computes it."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < a_programs:
        _rows(pid, a_ptr, wa_ptr, pos_ptr, cache_ptr, oa_ptr, a_stride_t, a_stride_h, n_tokens * a_heads, a_heads,
              n_cols, eps, cache_stride, ROWS, HALF, BLOCK_SIZE)
    else:
        _rows(pid - a_programs, b_ptr, wb_ptr, pos_ptr, cache_ptr, ob_ptr, b_stride_t, b_stride_h,
              n_tokens * b_heads, b_heads, n_cols, eps, cache_stride, ROWS, HALF, BLOCK_SIZE)


MIN_ROWS_FOR_BLOCKS = 4096
"""From this many (token, head) rows on (q and k together), the default is a block of rows per
program (about 170 tokens of Qwen3-1.7B); decode steps keep one row per program, which spreads a
few dozen rows over more SMs. Either gives the same bits."""

BLOCK_HEAD_DIMS = (64, 128, 256)
"""Head sizes whose multi-row layout is proven on an H100 (tests/gpu/test_ops_vs_vllm.py); other
sizes run one row per program."""


def default_rows(n_rows: int, head_dim: int) -> int:
    """Rows per program: one below MIN_ROWS_FOR_BLOCKS rows or for other head sizes, else a block
    of vLLM's norm width (8 rows at head_dim 128: the fastest of 4-32 on an H100, 126 vs 582 us for
    Qwen3-8B's q and k at 16,384 tokens)."""
    if n_rows < MIN_ROWS_FOR_BLOCKS or head_dim not in BLOCK_HEAD_DIMS:
        return 1
    return VLLM_NORM_BLOCK // head_dim


def _check_rows(rows: int, head_dim: int) -> None:
    if rows == 1:
        return
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"norm_rope: rows_per_program must be 1 or a power of two, got {rows}")
    if head_dim not in BLOCK_HEAD_DIMS or rows * head_dim < VLLM_NORM_BLOCK:
        raise ValueError(f"norm_rope: {rows} rows per program at head_dim {head_dim} would reduce each row in "
                         f"another order than vLLM's norm; use 1, or at least {VLLM_NORM_BLOCK} elements per "
                         f"block at head_dim {'/'.join(map(str, BLOCK_HEAD_DIMS))}")


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


def norm_rope_qk(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 rows_per_program: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary(rms_norm(q) * q_weight), rotary(rms_norm(k) * k_weight)) of heads q [T, Hq, D] and
    k [T, Hk, D] (any token/head strides, e.g. slices of the qkv output) at positions int64 [T], in
    one launch; returns new contiguous tensors. `rows_per_program`: 1, or a power of two with at
    least 1024 elements per block (see `_row_block`); by default chosen by the row count (same bits)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if k.dim() != 3 or k.shape[0] != t or k.shape[2] != d or positions.dim() != 1 or positions.shape[0] < t:
        raise ValueError(f"norm_rope_qk: q {list(q.shape)}, k {list(k.shape)} and positions {list(positions.shape)} "
                         f"must share the token count and head size ([T, Hq, D], [T, Hk, D], [>= T])")
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    _launch(q, q_weight, qo, k, k_weight, ko, eps, positions, cos_sin_cache, rows_per_program)
    return qo, ko


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
              cos_sin_cache: torch.Tensor, rows_per_program: int | None = None) -> torch.Tensor:
    """`norm_rope_qk` of one head tensor x [T, H, D]; returns a new contiguous [T, H, D]."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, weight, out, x[:, :0], weight, out, eps, positions, cos_sin_cache, rows_per_program)
    return out


def _launch(a, wa, oa, b, wb, ob, eps, positions, cache, rows_per_program):
    t, ha, d = a.shape
    hb = b.shape[1]
    rows = default_rows(t * (ha + hb), d) if rows_per_program is None else rows_per_program
    _check_rows(rows, d)
    a_programs = cdiv(t * ha, rows)
    grid = a_programs + cdiv(t * hb, rows)
    if grid:
        launch(_norm_rope_kernel, (grid, 1, 1),
               (a, wa, oa, a.stride(0), a.stride(1), ha, a_programs, b, wb, ob, b.stride(0), b.stride(1), hb,
                positions, cache, t, d, eps, cache.stride(0)),
               {"ROWS": rows, "HALF": d // 2, "BLOCK_SIZE": VLLM_NORM_BLOCK})
