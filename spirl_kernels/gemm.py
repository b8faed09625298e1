"""Batch-invariant bf16 GEMM: vLLM's reduction order, tile shapes chosen for speed.

    y = x @ w.T      x [M, K] bf16, w [N, K] bf16 (a Linear weight), y [M, N] bf16

vLLM 0.26's batch-invariant linear (`matmul_persistent`) runs one Triton config for every M:
128x128 tiles, BLOCK_K 64. Each output element is an fp32 accumulator that walks K in chunks of
64 in increasing order, each chunk one `tl.dot` (wgmma instructions of k=16 on sm_90), then is
rounded once to bf16. Those are the only things that fix the element's bits: which other rows or
columns share its tile does not enter its arithmetic. So any tile shape (BLOCK_M, BLOCK_N), warp
count or pipeline depth gives the same bits, as long as

  * BLOCK_K is 64 and the K loop runs in the same order with the same zero-padded tail, and
  * each 64-wide chunk is one `tl.dot` into the fp32 accumulator. On the H100 both instruction
    families Triton lowers it to (wgmma for BLOCK_M a multiple of 64 with >= 4 warps; mma.sync for
    16-row tiles) gave vLLM's bits in every case measured (6396e11:compare/bench_gemm.py, 2026-11-25).

That is what this kernel keeps, and what `tests/gpu/test_gemm.py` proves bit for bit against
vLLM's kernel over shapes and every config in `CONFIGS`. The config is then chosen by M: small
tiles at decode sizes (one token per sequence: M = batch), where 128x128 tiles leave most SMs idle
(16 tiles for a 2048-wide output) and a decode step must stream every weight at near bandwidth,
large tiles for the trainer's thousands of rows. Both the
engine (through `spirl.numerics.vllm_patches`) and the trainer run this kernel, so their bits agree.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import triton
import triton.language as tl

from spirl_kernels.gemm_tiles import BLOCK_K, tile_of
from spirl_kernels.launch import cdiv, launch, next_power_of_2

_log = logging.getLogger(__name__)


@triton.jit
def _bi_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                      stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, MASK_M: tl.constexpr):
    """MASK_M: rows past M are loaded as zeros instead of re-reading row 0 (vLLM clamps them).
    Either way they are computed and never stored, and an output row's arithmetic reads only its
    own row of `a`, so the stored rows' bits are the same; masking saves the re-reads where a
    64-row tile holds a handful of decode rows."""
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    offs_m = tl.where(row_ok, offs_m, 0).to(tl.int64)  # clamp, as vLLM does: rows past M
    offs_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)  # are computed and never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        k_left = K - ki * BLOCK_K
        if MASK_M:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    offs_cm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_cn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))


@triton.jit
def _bi_matmul_swap_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                           stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr):
    """`_bi_matmul_kernel` with the operands swapped, for decode (a handful of rows): each program
    computes the [BLOCK_N, BLOCK_M] tile of C^T = W X^T. The MMA's row operand is then BLOCK_N real
    weight rows instead of BLOCK_M mostly-masked activation rows, so a 16-row mma.sync tile streams
    16 weight rows per program with no shared memory spent on zeros, and a 2048-wide output still
    spreads over 128 programs. Each element is the same K loop (64-wide chunks in order, one
    `tl.dot` each, zero-padded tail) over the same products x[m, k] * w[n, k]. The tensor core sums
    a chunk's products into an element the same way with the operands' roles exchanged: on an H100
    every `swp_` config (mma.sync at 16 weight rows, wgmma at 64) was bitwise vLLM's kernel over
    `tests/gpu/test_gemm.py`'s shapes and Qwen3-1.7B's and 8B's linear layers at 1, 8 and 64 rows
    (2026-11-26); the test keeps checking it per config."""
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < M
    offs_m = tl.where(row_ok, offs_m, 0).to(tl.int64)
    offs_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk    # [BLOCK_N, BLOCK_K]
    xt_ptrs = a_ptr + offs_k[:, None] * stride_ak + offs_m[None, :] * stride_am   # [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BLOCK_K)):
        k_left = K - ki * BLOCK_K
        w = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        xt = tl.load(xt_ptrs, mask=row_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
        acc = tl.dot(w, xt, acc)
        w_ptrs += BLOCK_K * stride_bk
        xt_ptrs += BLOCK_K * stride_ak

    offs_cm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_cn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    c_ptrs = c_ptr + offs_cm[None, :] * stride_cm + offs_cn[:, None] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_cm[None, :] < M) & (offs_cn[:, None] < N))


@triton.jit
def _k_range(a_desc, b_desc, acc, row, col, k_lo, k_hi, BLOCK_K: tl.constexpr):
    """acc += the 64-wide K chunks k_lo..k_hi-1 of the tile at (row, col), in order, one `tl.dot` each."""
    for ki in range(k_lo, k_hi):
        a = a_desc.load([row, ki * BLOCK_K])
        b = b_desc.load([col, ki * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _bi_matmul_tma_kernel(a_desc, b_desc, c_desc, M, N, K,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr):
    """`_bi_matmul_kernel` with Hopper's TMA unit moving the tiles (host-made tensor descriptors):
    the same K loop in the same order, one `tl.dot` per 64-wide chunk; TMA fills out-of-bounds
    elements with zeros, as the masked loads do, so every element gets the same bits."""
    pid_m, pid_n = tile_of(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _k_range(a_desc, b_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, tl.cdiv(K, BLOCK_K), BLOCK_K)
    c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))


@triton.jit
def _bi_matmul_persistent_kernel(a_desc, a2_desc, b_desc, c_desc, c2_desc, M, N, K,
                                 BLOCK_M: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                                 TAIL: tl.constexpr = 0):
    """`_bi_matmul_tma_kernel` as a persistent kernel: one program per SM walks the tiles NUM_SMS apart (in
    `tile_of`'s grouped order), and `flatten=True` lets Triton software-pipeline across tile boundaries, so
    the next tile's TMA loads overlap this tile's last dots and its store. The epilogue's tile index is
    counted separately (`tile_c`), as Triton's persistent-matmul tutorial does, so that the pipelined loop
    does not keep the prologue's index alive into the store.

    BLOCK_M2 > 0 makes row tiles of BLOCK_M + BLOCK_M2 rows (128 + 16 = 144, 128 + 64, 256 + 16, ...), sizes
    Triton's power-of-two blocks lack; `a2_desc` and `c2_desc` are then TMA boxes of BLOCK_M2 rows (else
    None). A decode step of 129-144 rows then computes 144 rows once per weight tile instead of 256 (two
    128-row tiles, or one of 256): at Qwen3-8B's wide outputs (gate_up, lm_head) those steps are
    compute-bound, so the padded rows are the cost (cuBLAS runs 192 x 104 tiles there,
    6396e11:docs/rollout-profile.md). Each weight chunk is loaded once and feeds two `tl.dot`s: the first BLOCK_M
    rows as above, the last BLOCK_M2 rows with the operands swapped (W X^T, as `_bi_matmul_swap_kernel`),
    so the tensor-core instruction's row side is the weight tile, not a handful of activation rows.

    TAIL > 0 (with BLOCK_M2 = 0; `persistent_tail`): M leaves a last row tile of at most 64 rows, and that tile
    is computed from a TAIL-row box only (`a2_desc` / `c2_desc` are [TAIL, BLOCK_K] / [TAIL, BLOCK_N] boxes), with
    the operands swapped as above: a full BLOCK_M box there would load mostly rows past M, which the TMA unit
    zero-fills slowly, and its dot would multiply them (spirl_kernels/gemm_ws.py, "Row tails"). NUM_SMS is then the
    launch's program count, chosen so that a program's tiles fall in different row tiles (`persistent_programs`).

    Either way each element is one K loop in order, one `tl.dot` per 64-wide chunk into an fp32
    accumulator, with TMA's zero fill past K and past M: the module doc's conditions, so every element gets
    vLLM's bits."""
    start = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if TAIL > 0:
        last_m = M // BLOCK_M  # the row tile of the tail rows
        for tile in tl.range(start, tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), NUM_SMS):
            pid_m, pid_n = tile_of(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            if pid_m == last_m:
                acc_t = tl.zeros((BLOCK_N, TAIL), dtype=tl.float32)
                for ki in range(k_tiles):
                    at = a2_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                    b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
                    acc_t = tl.dot(b, at.T, acc_t)
                c2_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], tl.trans(acc_t.to(tl.bfloat16)))
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for ki in range(k_tiles):
                    a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                    b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
                    acc = tl.dot(a, b.T, acc)
                c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))
        return
    rows = BLOCK_M + BLOCK_M2
    num_tiles = tl.cdiv(M, rows) * tl.cdiv(N, BLOCK_N)
    tile_c = start - NUM_SMS
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_of(tile, M, N, rows, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_M2 > 0:
            acc2 = tl.zeros((BLOCK_N, BLOCK_M2), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * rows, ki * BLOCK_K])
            if BLOCK_M2 > 0:
                a2 = a2_desc.load([pid_m * rows + BLOCK_M, ki * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
            if BLOCK_M2 > 0:
                acc2 = tl.dot(b, a2.T, acc2)
        tile_c += NUM_SMS
        pid_m, pid_n = tile_of(tile_c, M, N, rows, BLOCK_N, GROUP_M)
        c_desc.store([pid_m * rows, pid_n * BLOCK_N], acc.to(tl.bfloat16))
        if BLOCK_M2 > 0:
            c2_desc.store([pid_m * rows + BLOCK_M, pid_n * BLOCK_N], tl.trans(acc2.to(tl.bfloat16)))


@triton.jit
def _bi_matmul_streamk_kernel(a_desc, b_desc, c_desc, part_ptr, flag_ptr, M, N, K, PER_ROW,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Stream-K with a sequential carry. Each row tile gets PER_ROW programs; the K chunks of its column
    tiles, laid end to end (column by column), are cut into PER_ROW equal runs, one per program. Every SM
    then does the same work even when the tile count is not a multiple of the SM count (1.7B gate_up at
    320 rows: 144 tiles of 128 x 256 on 132 SMs, a second wave of 12 tiles). Program q of every row tile
    walks the same columns at the same time, so a weight tile read from HBM for one row tile is still in
    L2 for the others (cutting the tiles in row-major order instead made each program read a column's
    row tiles one after another, and the weights came from HBM once per row tile).

    A tile cut between programs q and q + 1 is not summed from two partial sums (that would change the
    bits): program q computes its first chunks into the fp32 accumulator and stores it, exactly, to
    `part_ptr`'s slot, then raises its flag; program q + 1 waits for the flag, loads that accumulator and
    continues the same K loop from the next chunk with `tl.dot(a, b, acc)`. Each element is then one K
    loop in order, one `tl.dot` per 64-wide chunk into an fp32 accumulator, with TMA's zero fill past K
    and M: the module doc's conditions, so every element gets vLLM's bits. The wait costs no time: each
    program computes the head of its last tile first and the tail of its first tile last, so the head it
    waits for was its neighbour's first job. Programs never wait on a later program, and a launch that
    cuts tiles has at most one program per SM, all resident at once (`streamk_per_row`).

    Each run is at least one tile long (PER_ROW <= column tiles), so a tile is cut at most once. The
    consumer resets the flag to 0 (`atomic_cas`), leaving `flag_ptr` zeroed for the next launch.

        a [M, K], b [N, K] (a Linear weight), c [M, N] bf16 through TMA descriptors of [BLOCK_M, BLOCK_K],
        [BLOCK_N, BLOCK_K], [BLOCK_M, BLOCK_N]; grid (cdiv(M, BLOCK_M) * PER_ROW,); part_ptr fp32
        [grid, BLOCK_M, BLOCK_N] (scratch); flag_ptr int32 [>= grid], zero on entry and on exit."""
    pid = tl.program_id(0)
    row = (pid // PER_ROW) * BLOCK_M
    q = pid % PER_ROW
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(N, BLOCK_N).to(tl.int64) * k_tiles
    it0 = q * total // PER_ROW          # this program's chunks of its row tile: [it0, it1)
    it1 = (q + 1) * total // PER_ROW
    n_first = (it0 // k_tiles).to(tl.int32)
    n_last = ((it1 - 1) // k_tiles).to(tl.int32)
    k_tail = (it0 - n_first * k_tiles).to(tl.int32)   # > 0: the first tile's first k_tail chunks are q - 1's
    k_head = (it1 - n_last * k_tiles).to(tl.int32)    # < k_tiles: the last tile's rest is q + 1's
    tile_elems = BLOCK_M * BLOCK_N
    slot = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]

    if k_head < k_tiles:  # 1. the head of the last tile, for program q + 1
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _k_range(a_desc, b_desc, acc, row, n_last * BLOCK_N, 0, k_head, BLOCK_K)
        tl.store(part_ptr + pid * tile_elems + slot, acc)
        tl.debug_barrier()  # every thread's store before the flag
        tl.atomic_xchg(flag_ptr + pid, 1, sem="release", scope="gpu")
    for n in range(n_first + (k_tail > 0).to(tl.int32), n_last + (k_head == k_tiles).to(tl.int32)):  # 2. whole
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _k_range(a_desc, b_desc, acc, row, n * BLOCK_N, 0, k_tiles, BLOCK_K)
        c_desc.store([row, n * BLOCK_N], acc.to(tl.bfloat16))
    if k_tail > 0:  # 3. the tail of the first tile, after program q - 1's head of it
        while tl.atomic_cas(flag_ptr + pid - 1, 1, 0, sem="acquire", scope="gpu") != 1:
            pass
        tl.debug_barrier()
        acc = tl.load(part_ptr + (pid - 1) * tile_elems + slot, cache_modifier=".cg")
        acc = _k_range(a_desc, b_desc, acc, row, n_first * BLOCK_N, k_tail, k_tiles, BLOCK_K)
        c_desc.store([row, n_first * BLOCK_N], acc.to(tl.bfloat16))


# (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages); BLOCK_K is always 64.
CONFIGS = {
    "vllm": (128, 128, 8, 8, 3),      # vLLM 0.26's own bf16 config (picked at 513-1023 rows, outputs > 2048 wide)
    "m64_n32": (64, 32, 1, 4, 6),
    "m64_n64": (64, 64, 1, 4, 5),
    "m64_n128": (64, 128, 8, 4, 4),
    "m128_n128": (128, 128, 8, 8, 4),
    "m128_n256": (128, 256, 8, 8, 3),  # not picked; kept so the bitwise test covers wide tiles
    "m128_n128_s5": (128, 128, 8, 8, 5),
    "m256_n128": (256, 128, 8, 8, 3),  # picked from 2048 rows until the persistent kernel (2026-11-26)
    # not picked (slower everywhere measured); kept so the bitwise test covers them
    "m128_n256_s4": (128, 256, 8, 8, 4),
    "m128_n64": (128, 64, 8, 4, 4),
    # TMA loads and stores (`_bi_matmul_tma_kernel`), not picked: bitwise vLLM's (tests/gpu/test_gemm.py),
    # and at 8192 rows tma_m128_n256 beat m256_n128 by 1-8 % on qkv/o/gate_up/down (6396e11:compare/bench_gemm.py,
    # H100), but the one end-to-end try (tma_m256_n128, tma_m128_n128 for qkv) made the trainer's forward
    # 1.01-1.05x torchtitan, against 0.98-1.02x with the pointer kernel's m256_n128.
    "tma_m128_n128": (128, 128, 8, 8, 4),
    "tma_m128_n256": (128, 256, 8, 8, 3),
    "tma_m256_n128": (256, 128, 8, 8, 3),
    # Decode tiles (issue 28): 64 rows (wgmma's smallest), narrow columns so that a 2048-wide output
    # still spreads over ~128 programs, deep pipelines to keep enough weight bytes in flight.
    # "dec_": the pointer kernel with rows past M masked to zeros; "tma_": TMA zero-fills them.
    "dec_m64_n16": (64, 16, 1, 4, 8),
    "dec_m64_n32": (64, 32, 1, 4, 8),
    "dec_m64_n64": (64, 64, 1, 4, 6),
    "dec_m64_n128": (64, 128, 1, 4, 4),
    # decode tiles with deeper pipelines, picked for outputs at most 4096 wide (`pick_config`), where
    # 8-stage 32-wide tiles left half the SMs idle (2048-wide) or starved them of bytes in flight;
    # dec_m16_n16 (mma.sync) is not picked: fastest only on single shapes
    "dec_m64_n16_s12": (64, 16, 1, 4, 12),
    "dec_m64_n32_s12": (64, 32, 1, 4, 12),
    "dec_m16_n16": (16, 16, 1, 2, 12),
    # swapped operands (`_bi_matmul_swap_kernel`, decode of wide outputs): BLOCK_M is the activation
    # rows (the MMA's column side, 16 at least for tl.dot), BLOCK_N the weight rows per program
    "swp_m16_n16": (16, 16, 1, 1, 12),
    "swp_m16_n16_w2": (16, 16, 1, 2, 12),
    "swp_m16_n32": (16, 32, 1, 2, 10),
    "swp_m16_n64": (16, 64, 1, 4, 8),
    "swp_m16_n16_s16": (16, 16, 1, 1, 16),
    "tma_m64_n16": (64, 16, 1, 4, 8),
    "tma_m64_n32": (64, 32, 1, 4, 8),
    "tma_m64_n64": (64, 64, 1, 4, 6),
    # Persistent TMA kernel (`_bi_matmul_persistent_kernel`, issue 28): one program per SM. A standalone
    # probe on an H100 (2026-11-26, 8192^3, 16384x24576x4096, 4096x4096x12288) gave 680-686 TFLOP/s for
    # 128x256 tiles, 8 warps, 3 stages, against cuBLAS's 679-708 and 538-574 for the pointer kernel.
    # Warp-specialized variants (tl.range(warp_specialize=True)) were slower, and one (128x128, 5
    # stages) did not reproduce the pointer kernel's bits, so none is used.
    "pers_m128_n256": (128, 256, 8, 8, 3),
    "pers_m128_n128": (128, 128, 8, 8, 4),
    "pers_m256_n128": (256, 128, 8, 8, 3),
    "pers_m64_n128": (64, 128, 8, 4, 4),
    # mma.sync tiles (16 rows; Triton lowers BLOCK_M < 64 to mma v2, not wgmma), not picked: they gave
    # vLLM's bits in every bench_gemm case on the H100 (2026-11-25); kept so the bitwise test covers them.
    "dec_m16_n32": (16, 32, 1, 2, 8),
    "dec_m16_n64": (16, 64, 1, 4, 6),
    # Tried for decode steps of 65-512 rows (issue 39): GROUP_M 8 so a column tile's row tiles run back
    # to back (the weights come from HBM once, then L2), masked rows ("dec_"), one 256-row tile (each
    # weight read once), and the persistent kernel with narrower tiles. dec_m64_n32_g8 and dec_m64_n64_g8
    # are picked (`pick_config`); the others were slower at every row count measured (the 256-row tiles
    # by 1.5-4x: too few programs), kept so the bitwise test covers them.
    "m64_n32_g8": (64, 32, 8, 4, 6),
    "m64_n64_g8": (64, 64, 8, 4, 5),
    "dec_m64_n32_g8": (64, 32, 8, 4, 6),
    "dec_m64_n64_g8": (64, 64, 8, 4, 5),
    "m128_n32": (128, 32, 8, 4, 5),
    "m256_n32": (256, 32, 1, 8, 4),
    "m256_n64": (256, 64, 1, 8, 3),
    "pers_m128_n64": (128, 64, 8, 4, 4),
    "pers_m64_n64": (64, 64, 8, 4, 5),
    # Row tiles of two parts (`_bi_matmul_persistent_kernel` with BLOCK_M2 > 0, issue 39): BLOCK_M is the tile's
    # rows, split into the largest power of two below it and the rest (144 = 128 + 16). Picked at 129-144 rows for
    # outputs wider than 8192. Also measured (2026-11-26/27): 160, 192, 272 and 320 rows (128/256 + 32/64/16/64),
    # 16-64 wide tiles of 144-192 rows for the narrow layers, 256 wide tiles of 160/192 rows with 2 stages, and
    # one-part 256 x 16/32 tiles: all bitwise vLLM's, none faster than the picks where it would be picked
    # (6396e11:docs/rollout-profile.md), so they are not kept.
    "p2_m144_n128": (144, 128, 8, 8, 4),
    "p2_m144_n256": (144, 256, 8, 8, 3),
    # Stream-K with a sequential carry (`_bi_matmul_streamk_kernel`, issue 39): the SMs shared out
    # among the row tiles, each the same number of K chunks, for tile counts that leave a last wave part-empty.
    # GROUP_M is unused (the kernel walks every row tile's columns in step).
    "sk_m64_n32": (64, 32, 1, 4, 6),
    "sk_m64_n64": (64, 64, 1, 4, 5),
    "sk_m64_n128": (64, 128, 1, 4, 4),
    "sk_m128_n64": (128, 64, 1, 4, 4),
    "sk_m128_n128": (128, 128, 1, 8, 4),
    "sk_m128_n256": (128, 256, 1, 8, 3),
    # One wave of 64-row tiles with deep pipelines (issue 39): where the tiles fit one program per SM,
    # 7-8 stages keep as many bytes in flight per SM as two programs of 5 stages (`pick_config`).
    "dec_m64_n64_s8": (64, 64, 1, 4, 8),
    "dec_m64_n128_s7": (64, 128, 1, 4, 7),
    # Warp-specialized TMA tiles (spirl_kernels/gemm_ws.py, issue 39): a loader warp keeps `num_stages` K
    # chunks in flight while the MMA warps (num_warps) wait on mbarriers only. Off Hopper, or for tensors TMA cannot
    # address, the pointer kernel runs the same tile with rows past M masked (the same bits).
    "ws_m64_n64_s6": (64, 64, 8, 4, 6),
    "ws_m64_n128_s6": (64, 128, 8, 4, 6),
    "ws_m64_n128_s8": (64, 128, 8, 4, 8),
    "ws_m128_n64_s8": (128, 64, 8, 4, 8),
    "ws_m128_n128_s5": (128, 128, 8, 4, 5),
    "ws_m128_n128_s6": (128, 128, 8, 4, 6),
    "ws_m64_n256_s5": (64, 256, 8, 4, 5),
    "ws_m128_n256_s4": (128, 256, 8, 8, 4),
    # Swapped operands, warp-specialized (spirl_kernels/gemm_ws.py `_bi_matmul_ws_swapped_kernel`): one program
    # per BLOCK_N weight rows covering up to BLOCK_M = 192 rows of x (128 + 8/16/32/64), each weight byte read once.
    # Off Hopper the pointer kernel runs 64 x min(BLOCK_N, 128) tiles instead (the same bits).
    "wsx_n128_s5": (192, 128, 1, 8, 5),
    "wsx_n256_s4": (192, 256, 1, 8, 4),
}


_H100_SMS = 132
"""SMs of the H100 (and H200) the picks were measured on: `pick_config` reads waves of this many programs."""


def pick_config(m: int, n: int, k: int) -> str:
    """Tile config for an [m, k] x [k, n] product. Every config gives the same bits (module doc), so this picks for
    speed only, from `6396e11:compare/bench_gemm.py` on H100s at the Qwen3-1.7B, 4B and 8B linear shapes (from
    2026-11-27 with `--graph`: CUDA-graph replays with the weights from HBM, as decode runs them; do_bench's Python
    launches cost 70-90 us of host time per TMA-descriptor launch there). Each rule's measurements, and the tiles that
    lost, are in 6396e11:docs/rollout-profile.md (issues 28 and 39, one dated section each); _H100_SMS is the wave size.

    * At most 16 rows and outputs wider than 4096: the swapped-operand kernel (the few activation rows are the MMA's
      narrow side), 32 weight rows per program up to 16,384 wide, else 16 with 16 stages (lm_head: 8B 416-423 us
      against cuBLAS's 446-449).
    * At most 64 rows: masked 64-row tiles narrow enough to spread the output over at least 128 programs, with 12
      stages up to 4096 wide (1.7B down 20.3-21.4 us at 1-8 rows against cuBLAS's 19.5-19.7).
    * 65-512 rows: a decode step replays the CUDA graph of the next capture size (multiples of 8 to 256, then of
      16), so every tile here is masked or TMA-loaded (unmasked pointer tiles were 1.3-2x slower at row counts such
      as 72, 136, 200, 272):
        - `_warp_specialized_pick` first (spirl_kernels/gemm_ws.py): the one-wave warp-specialized tile with the most
          programs (its docstring);
        - wider than 8192 at 129-192 rows: the swapped warp-specialized kernel over every row at once, each weight
          byte read once (256 weight rows per program where that makes one wave over at least half the SMs, else
          128): 8B gate_up at 136 rows 87 us against 91 before, cuBLAS 79-80;
        - wider than 8192 otherwise: two-part 144-row tiles (128 + 16, no padded second 128-row tile) at 129-144
          rows; at up to 128 rows persistent 128x256 tiles where they make 96 tiles or more, else TMA 128x128;
          above, stream-K 128x256 tiles where they leave a second wave of at most a quarter of the SMs (1.7B
          gate_up at 272-384 rows 41-46 us against 49-51), else persistent 128x128 at up to 320 rows where they
          make at most 8 waves, with the last row tile's 1-64 rows loaded alone (`persistent_tail`; 8B gate_up at
          257-320 rows 130-134 us against 137-142 for 128x256, cuBLAS 86-97), else persistent 128x256;
        - up to 8192 wide, not taken above: at up to 128 rows the pointer kernel's one wave of 64x32 tiles (where
          they make one) or 64x64 tiles with 8 stages; else the persistent kernel, 128x128 (128x256 above 256 rows
          and 4096 wide), which overlaps a tile's store with the next tile's loads (1.7B qkv at 264-512 rows).
    * 513-1023 rows: vLLM's own 128x128 tiles (5 stages up to 2048 wide).
    * 1024 rows and up (long prefills, the trainer): persistent 128x256 tiles, within -4..+6 % of cuBLAS from 2048
      rows (8B qkv 607 us at 8192 rows against cuBLAS's 635), except 4097-8192 wide below 2048 rows, where 128x256
      tiles make 1.5 waves and 128x128 tiles were 10 % faster."""
    if m <= 16 and n > 4096:
        return "swp_m16_n32" if n <= 16384 else "swp_m16_n16_s16"
    if m <= 64:
        if n <= 2048:
            return "dec_m64_n16_s12"
        return "dec_m64_n32_s12" if n <= 4096 else "dec_m64_n32"
    if m <= 512:
        ws = _warp_specialized_pick(m, n, k)
        if ws:
            return ws
        if n > 8192:
            if 128 < m <= CONFIGS["wsx_n256_s4"][0]:  # swapped warp-specialized tiles over every row at once
                if _H100_SMS // 2 <= cdiv(n, 256) <= _H100_SMS:  # one wave of 256 weight rows, half the SMs
                    return "wsx_n256_s4"
                if cdiv(n, 128) <= _H100_SMS:
                    return "wsx_n128_s5"
            if 128 < m <= 144:
                return "p2_m144_n256" if cdiv(n, 256) >= 96 else "p2_m144_n128"
            tiles = cdiv(m, 128) * cdiv(n, 256)
            if m <= 128:
                return "pers_m128_n256" if tiles >= 96 else "tma_m128_n128"
            if _H100_SMS < tiles <= _H100_SMS * 5 // 4:  # a second wave of at most a quarter of the SMs
                return "sk_m128_n256"
            if m <= 320 and cdiv(m, 128) * cdiv(n, 128) <= 8 * _H100_SMS:
                return "pers_m128_n128"  # a last row tile of 1-64 rows is loaded alone (persistent_tail)
            return "pers_m128_n256"
        if m <= 128:  # here 64x64 tiles make one wave: 64x32 tiles where those do too, else 8 stages deep
            return "dec_m64_n32" if cdiv(m, 64) * cdiv(n, 32) <= _H100_SMS else "dec_m64_n64_s8"
        return "pers_m128_n128" if m <= 256 or n <= 4096 else "pers_m128_n256"  # no one-wave warp-specialized tile
    if m < 1024:
        return "m128_n128_s5" if n <= 2048 else "vllm"
    if m < 2048 and 4096 < n <= 8192:
        return "pers_m128_n128"
    return "pers_m128_n256"


def compile_key(m: int, n: int, k: int) -> tuple:
    """What `matmul` at m rows of an [N, K] weight compiles: its config (`pick_config`), Triton's specialization of
    the row count (1, a multiple of 16, neither) and, for the warp-specialized configs, the TMA boxes of the rows
    past the last full row tile (spirl_kernels/gemm_ws.py, "Row tails"), which are part of the compiled kernel. Two row
    counts with equal keys run one compiled kernel (spirl/loops/precompile.py builds each key once). The persistent
    kernel's row tail and program count (`persistent_tail`, `persistent_programs`) are constexprs too; the count is
    taken for an H100's 132 SMs, as `pick_config`'s waves are."""
    config = pick_config(m, n, k)
    key = (n, k, config, m == 1, m % 16 == 0)
    if config.startswith("pers_"):
        return key + persistent_launch(m, n, config, _H100_SMS)
    if not config.startswith(("ws_", "wsx_")):
        return key
    from spirl_kernels import gemm_ws

    block = CONFIGS[config][0]
    if config.startswith("ws_"):
        return key + gemm_ws.tail_boxes(m, block)
    launches = {min(block, m - lo) for lo in range(0, m, block)}  # `matmul_swapped_into`'s launches of <= BLOCK_M rows
    return key + tuple(sorted((r == 1, r % 16 == 0, gemm_ws.swapped_boxes(r)) for r in launches))


_WS_TILES = ("ws_m64_n128_s8", "ws_m128_n64_s8", "ws_m128_n128_s6", "ws_m64_n256_s5")
"""`_warp_specialized_pick`'s candidates, in its order of preference where two make as many programs."""


def _warp_specialized_pick(m: int, n: int, k: int) -> str | None:
    """`pick_config`'s warp-specialized tile for m in 65-512 rows, or None: of `_WS_TILES` that make one wave, the
    one with the most programs (64-row tiles first on a tie), tiles of 128x128 elements or more only where K >= 2560;
    at up to 128 rows none where K < 8192 and the pointer kernel's 64x64 tiles make one wave. Outputs wider than
    8192 meet them only where 64x256 tiles make one wave (Qwen3-32B qkv, 10,240 wide, at up to 192 rows).

    Measured (H100, 2026-11-27, `6396e11:compare/bench_gemm.py --graph`, all bitwise vLLM's; the rollout profile:
    `6396e11:docs/rollout-profile.md`): the pointer kernel moved the same bytes as cuBLAS with 4x its instructions (ncu,
    8B o at 160 rows), which a TMA loader warp removes (spirl_kernels/gemm_ws.py); with the last row tile loading only its own
    rows ("Row tails" there), per 8B layer at 136 rows qkv + o + down 89.0 us against 101.7 with the full-box picks and
    cuBLAS's 84.1 (down 44.9 against 46.5); at 1.7B within 4 % of the best of the four tiles at 128-512 rows except qkv
    at 264-272 rows, where the K bound keeps the persistent kernel (15.9-16.4 us against 64x256's 15.2-15.5). Kept
    elsewhere: the pointer kernel's one-wave tiles at up to 128 rows and K < 8192 (1.7B o/down at 128 rows 7.9/18.3 us
    against 9.2/19.4; 8B down at 128 rows, K = 12,288, went to 64x128 warp-specialized tiles: 43.9 against 48.2); the
    persistent kernel at K = 2048 beyond one wave (6-15 % faster than 64x256 tiles at 1.7B qkv 320-512 rows)."""
    if m <= 128 and k < 8192 and cdiv(m, 64) * cdiv(n, 64) <= _H100_SMS:
        return None  # the pointer kernel's one wave of 64x32 or 64x64 tiles (below) is kept
    best, most = None, 0
    for name in _WS_TILES:
        bm, bn = CONFIGS[name][:2]
        programs = cdiv(m, bm) * cdiv(n, bn)
        if most < programs <= _H100_SMS and (bm * bn < 128 * 128 or k >= 2560):
            best, most = name, programs
    return best


TAIL_STORE_ELEMENTS = 32 * 256
"""The largest tail tile (rows x BLOCK_N) `_bi_matmul_persistent_kernel` takes: its TMA store needs shared memory of
its own, and 128 x 256 tiles with 3 stages leave 16 KB (sm_90: 213 KB without a tail, 221 KB with 16 rows, 229 KB
with 32, 246 KB with 64, above the 227 KB an SM offers)."""


def persistent_tail(m: int, block_m: int, block_n: int) -> int:
    """`_bi_matmul_persistent_kernel`'s TAIL for a one-part launch over m rows in BLOCK_M x BLOCK_N tiles: the rows of
    the box that loads the last row tile where m leaves 1-64 rows there (a power of two, at least 16: the swapped
    dot's narrowest side) and the tile fits TAIL_STORE_ELEMENTS, else 0 (a full box loads it).

    Only for decode steps (at most 512 rows), and with 256-wide tiles only for tails of at most 16 rows: the tail
    variant gives up Triton's pipelining across tiles (`flatten`), and that cost more than the tail saved at a
    prefill's 2,064 rows (8B gate_up 608 -> 661 us) and at 160 rows in 128 x 256 tiles (8B lm_head 516 -> 549),
    while at 257 rows it saved 8B lm_head 795 -> 671 us and 128 x 128 tiles gained at every row count of 129-320
    (8B gate_up 272 rows 194 -> 131; H100, CUDA-graph replays, 2026-11-27)."""
    rest = m % block_m
    tail = max(16, next_power_of_2(rest)) if rest else 0
    longest = 16 if block_n > 128 else 64
    if block_m != 128 or m > 512 or not 0 < rest <= longest or tail * block_n > TAIL_STORE_ELEMENTS:
        return 0
    return tail


def persistent_programs(m: int, n: int, block_m: int, block_n: int, group_m: int, sms: int, tail: int) -> int:
    """`_bi_matmul_persistent_kernel`'s NUM_SMS (the tile stride; the grid is at most this many programs): the
    SM count, except with a row tail and more tiles than SMs: then the largest count up to it that shares no
    factor with the row tiles of a group (`tile_of` takes a column's row tiles one after another), so that a
    program's tiles walk through the row tiles instead of landing in one (at 272 rows, 3 row tiles of 128 on
    132 SMs, a third of the programs would get only tail tiles and the others three full tiles)."""
    rows = -(-m // block_m)
    if not tail or rows * -(-n // block_n) <= sms:
        return sms
    period = min(rows, group_m)
    programs = sms
    while math.gcd(programs, period) != 1:
        programs -= 1
    return programs


def persistent_launch(m: int, n: int, config: str, sms: int) -> tuple[int, int]:
    """(TAIL, NUM_SMS) of `_bi_matmul_persistent_kernel` for `config` at m rows of an N-wide output on `sms` SMs:
    `persistent_tail` (0 for two-part tiles, whose BLOCK_M is not 128) and `persistent_programs`."""
    bm, bn, gm = CONFIGS[config][:3]
    tail = persistent_tail(m, bm, bn)
    return tail, persistent_programs(m, n, bm, bn, gm, sms, tail)


@functools.cache
def _num_sms(device: torch.device) -> int:
    """The persistent kernel's program count: one per SM of the device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def streamk_per_row(m: int, n: int, bm: int, bn: int, sms: int) -> int:
    """Programs per row tile of `_bi_matmul_streamk_kernel`: the SMs shared out among the row tiles, at most
    one per column tile (each program's run at least one tile long). Where that leaves one program per row
    tile (more row tiles than SMs: long prefills), no tile is cut and nothing waits, so the launch may
    have more programs than SMs."""
    return max(1, min(sms // cdiv(m, bm), cdiv(n, bn)))


_STREAMK_FLAGS: dict[torch.device, torch.Tensor] = {}


def _streamk_flags(device: torch.device) -> torch.Tensor | None:
    """The stream-K kernel's int32 flags, one per SM, zero between launches (the kernel resets what it raises).
    Made on the first stream-K call outside CUDA-graph capture: made inside one, the zeroing would only be
    recorded, not run, so a capture before any eager call gets None (the caller then runs the same tiles
    without stream-K: the same bits). One buffer per device: two stream-K GEMMs must not run at once on
    two streams of one device (neither vLLM's engine nor the trainer does that)."""
    flags = _STREAMK_FLAGS.get(device)
    if flags is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            _log.warning("spirl_kernels.gemm: a stream-K GEMM was first called inside CUDA-graph capture; the graph runs "
                         "the same tiles without stream-K (same bits, slower). Call spirl_kernels.gemm.matmul once "
                         "outside capture first.")
            return None
        flags = _STREAMK_FLAGS[device] = torch.zeros(_num_sms(device), dtype=torch.int32, device=device)
    return flags


def _tma_ok(*ts: torch.Tensor) -> bool:
    """TMA needs row-major tensors with 16-byte aligned rows and base addresses (else the pointer
    kernel runs the same tiles: the same bits either way)."""
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in ts)


def matmul(x: torch.Tensor, w: torch.Tensor, config: str | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K].T -> [..., N] in x's dtype (bf16), bitwise equal to vLLM's
    `linear_batch_invariant` for every row count."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"spirl_kernels.gemm.matmul takes bf16 tensors, got {x.dtype} and {w.dtype}")
    lead = x.shape[:-1]
    a = x.reshape(-1, x.shape[-1])
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"matmul: x has K={k} but w is {list(w.shape)}")
    c = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return c.reshape(*lead, n)
    config = config or pick_config(m, n, k)
    bm, bn, gm, warps, stages = CONFIGS[config]
    grid = (cdiv(m, bm) * cdiv(n, bn), 1, 1)
    tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=gm)
    first = 1 << (bm.bit_length() - 1)  # a two-part row tile's first part (144 -> 128 + 16); else bm
    flags = _streamk_flags(x.device) if config.startswith("sk_") else None
    if (config.startswith(("pers_", "tma_", "p2_")) or flags is not None) and _tma_ok(a, w, c):
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_d, w_d, c_d = (TensorDescriptor.from_tensor(a, [first, BLOCK_K]),
                         TensorDescriptor.from_tensor(w, [bn, BLOCK_K]), TensorDescriptor.from_tensor(c, [first, bn]))
        if config.startswith("tma_"):
            launch(_bi_matmul_tma_kernel, grid, (a_d, w_d, c_d, m, n, k), tiles, num_warps=warps,
                   num_stages=stages)
            return c.reshape(*lead, n)
        if flags is not None:
            per_row = streamk_per_row(m, n, bm, bn, _num_sms(x.device))
            programs = cdiv(m, bm) * per_row
            part = torch.empty((programs, bm, bn), device=x.device, dtype=torch.float32)
            launch(_bi_matmul_streamk_kernel, (programs, 1, 1), (a_d, w_d, c_d, part, flags, m, n, k, per_row),
                   dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K), num_warps=warps, num_stages=stages)
            return c.reshape(*lead, n)
        m2 = bm - first  # rows of a two-part tile's second part; 0 for one-part tiles
        tail, programs = persistent_launch(m, n, config, _num_sms(x.device))
        a2_d, c2_d = ((TensorDescriptor.from_tensor(a, [m2 or tail, BLOCK_K]),
                       TensorDescriptor.from_tensor(c, [m2 or tail, bn])) if m2 or tail else (None, None))
        launch(_bi_matmul_persistent_kernel, (min(programs, grid[0]), 1, 1), (a_d, a2_d, w_d, c_d, c2_d, m, n, k),
               {**tiles, "BLOCK_M": first, "NUM_SMS": programs, "BLOCK_M2": m2, "TAIL": tail}, num_warps=warps,
               num_stages=stages)
        return c.reshape(*lead, n)
    if config.startswith(("ws_", "wsx_")):
        from spirl_kernels import gemm_ws

        if gemm_ws.runs_on(x.device) and _tma_ok(a, w, c):
            if config.startswith("wsx_"):
                gemm_ws.matmul_swapped_into(a, w, c, bm, bn, warps, stages)
            else:
                gemm_ws.matmul_into(a, w, c, bm, bn, gm, warps, stages)
            return c.reshape(*lead, n)
        if config.startswith("wsx_"):  # the pointer kernel's masked 64-row tiles instead (the same bits)
            bm = first = 64
            bn = min(bn, 128)
            grid = (cdiv(m, bm) * cdiv(n, bn), 1, 1)
            tiles.update(BLOCK_M=bm, BLOCK_N=bn)
            warps = 4
        stages = min(stages, 4)  # without TMA; 4 stages fit any GPU's shared memory
    ptrs = (a, w, c, m, n, k, a.stride(0), a.stride(1), w.stride(1), w.stride(0), c.stride(0), c.stride(1))
    if config.startswith("swp_"):
        launch(_bi_matmul_swap_kernel, grid, ptrs, tiles, num_warps=warps, num_stages=stages)
    elif first != bm:  # a two-part tile without TMA: the pointer kernel's masked tiles of its first part
        grid = (cdiv(m, first) * cdiv(n, bn), 1, 1)
        launch(_bi_matmul_kernel, grid, ptrs, {**tiles, "BLOCK_M": first, "MASK_M": True}, num_warps=warps,
               num_stages=stages)
    else:
        launch(_bi_matmul_kernel, grid, ptrs,
               {**tiles, "MASK_M": config.startswith(("dec_", "sk_", "ws_", "wsx_"))}, num_warps=warps,
               num_stages=stages)
    return c.reshape(*lead, n)
