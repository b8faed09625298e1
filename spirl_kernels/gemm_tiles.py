"""What the batch-invariant GEMM kernels (spirl_kernels/gemm.py's Triton kernels, spirl_kernels/gemm_ws.py's Gluon kernels) share:
vLLM's K step and the order in which programs take tiles. Below both, so neither imports the other."""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_K = 64
"""The K step of vLLM's bf16 config; it (not the tile shape) decides every element's bits."""


@triton.jit
def tile_of(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) that program `pid` computes, in grouped order: GROUP_M row tiles
    in a row share each column tile while it is in L2. Which program computes a tile does not
    enter any element's arithmetic."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % group) % group_m, (pid % group) // group_m
