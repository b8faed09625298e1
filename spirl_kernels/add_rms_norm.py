"""Residual add + RMSNorm in one Triton pass, with the bits of the two kernels it replaces.

Every norm of a Qwen3 layer but the first takes the residual stream. With `vllm_patches` in
place, vLLM's engine runs it as two kernels per norm: `residual.add_(x)` (a bf16 add: the fp32 sum
of the two bf16 values, rounded once) and `rms_norm_batch_invariant(residual)` (vLLM's Triton
`_rms_norm_kernel`). At decode sizes both are launch-bound, and the add is one more pass over the
stream. This kernel computes, per row:

  * r = bf16(float(x) + float(residual)): the same fp32 add and the same single rounding as
    torch's bf16 `add_`, so r is bitwise the residual the two-kernel path writes;
  * the sum of squares of r in vLLM's `_rms_norm_kernel`'s shape - a 1024-wide masked block per
    iteration, `tl.sum`, launched with the same (default) warps. The squares of bf16 values are
    exact in fp32, so the reduction tree alone fixes the sum, and identical code over an identically
    shaped block compiles to the identical tree (as `spirl_kernels/qk_norm_rope.py`);
  * out = bf16((float(r) * inv_rms) * float(w)), vLLM's step 3.

The row is held as a [blocks, 1024] tile (each tile row one of vLLM's blocks), so x, the residual
and the weight are read once, in one round of loads: a decode row's norm is launch- and latency-bound.
Why the bits are the looped form's: compiled for sm_90 by Triton 3.6, the tile's axis-1 reduction
takes each block in the 1-D block's layout (8 contiguous elements a thread, 32 lanes, 4 warps) and
the PTX has the same per-thread fma chain in the same element order, the same butterfly shuffles and
the same cross-warp step; the block sums are added in block order. Measured on an H200 (2026-11-28,
CUDA-graph replays, us a call, two-pass unrolled -> one pass): 2,048 wide 2.06 -> 1.56 (1 row),
4,096 3.36 -> 1.90, 5,120 3.89 -> 2.26; at 1,024 wide (Qwen3-0.6B) 1.33 -> 1.42 at 1 row, and
from 2,048 rows 1 % slower to 10 % faster. Residual and output `torch.equal` to the two-pass
kernel's and to vLLM's two kernels at widths 1,024-5,120 and 1-8,192 rows;
`tests/gpu/test_ops_vs_vllm.py` is the standing proof of the bits, and
`tests/test_add_rms_norm_interpreter.py` checks the tile's indexing on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spirl_kernels.launch import launch

VLLM_NORM_BLOCK = 1024
"""`rms_norm_batch_invariant`'s BLOCK_SIZE: the reduction's block shape, hence its bits."""


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, x_stride, res_stride, out_stride, n_cols, eps,
                         BLOCK_SIZE: tl.constexpr, NUM_BLOCKS: tl.constexpr, BLOCKS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dtype = res_ptr.dtype.element_ty
    blocks = tl.arange(0, BLOCKS_P2)
    col_idx = blocks[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]  # row b: vLLM's b-th block
    mask = col_idx < n_cols
    w = tl.load(w_ptr + col_idx, mask=mask, other=1.0)
    r = (tl.load(x_ptr + row * x_stride + col_idx, mask=mask, other=0.0).to(tl.float32)
         + tl.load(res_ptr + row * res_stride + col_idx, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    r_f32 = r.to(tl.float32)
    block_sums = tl.sum(tl.where(mask, r_f32 * r_f32, 0.0), axis=1)  # each block's tl.sum, as vLLM's loop
    sum_sq = tl.zeros([1], dtype=tl.float32)
    for b in tl.static_range(NUM_BLOCKS):  # added in block order; picking one block sum out of zeros is exact
        sum_sq += tl.sum(tl.where(blocks == b, block_sums, 0.0))
    mean_sq = sum_sq / n_cols
    rms = tl.sqrt(mean_sq + eps)
    inv_rms = 1.0 / rms
    out = (r_f32 * inv_rms) * w.to(tl.float32)
    tl.store(res_ptr + row * res_stride + col_idx, r, mask=mask)
    tl.store(out_ptr + row * out_stride + col_idx, out.to(dtype), mask=mask)


def fusable(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """What the kernel covers: 2-D CUDA bf16/fp16 x and residual of one shape, unit last stride,
    the weight [N] contiguous in the same dtype (Qwen3's norms)."""
    return (x.is_cuda and x.dim() == 2 and x.shape == residual.shape and x.dtype == residual.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1 and residual.stride(-1) == 1
            and weight is not None and weight.dtype == x.dtype and weight.shape == (x.shape[-1],)
            and weight.is_contiguous())


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual <- bf16(residual + x) in place; returns rms_norm(residual) * weight (a new tensor)."""
    rows, n = x.shape
    blocks = triton.cdiv(n, VLLM_NORM_BLOCK)
    out = torch.empty_like(residual)
    if rows:
        launch(_add_rms_norm_kernel, (rows, 1, 1),
               (x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), n, eps),
               {"BLOCK_SIZE": VLLM_NORM_BLOCK, "NUM_BLOCKS": blocks, "BLOCKS_P2": triton.next_power_of_2(blocks)})
    return out
