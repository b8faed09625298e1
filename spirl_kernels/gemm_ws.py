"""Warp-specialized batch-invariant GEMM for Hopper decode steps (Gluon): y = x @ w.T with vLLM's bits.

    x [M, K] bf16, w [N, K] bf16 (a Linear weight), y [M, N] bf16; M a decode step's rows (65-512).

Why it exists (issue 39, 2026-11-27; 6396e11:docs/rollout-profile.md): at Qwen3-8B's o projection with 160 rows,
`_bi_matmul_kernel`'s 128 x 64 tiles and cuBLAS's 64 x 80 tiles move the same 151 MB from L2 to the SMs
(ncu, H100), yet cuBLAS took 17.3 us and the pointer kernel 24.0. The pointer kernel's 128 threads issue
every 16-byte cp.async copy themselves, then wait for them and meet at a CTA barrier before each wgmma
(4x cuBLAS's instruction count); one program per SM then moved about 30 bytes a cycle. cuBLAS (and this
kernel) gives the copies to one producer warp driving the TMA unit and lets the MMA warpgroup wait on
mbarriers only, so the copies of STAGES K steps stay in flight while the tensor cores work.

Partitions (`gl.warp_specialize`):
  * loader (1 warp, 40 registers): for each 64-wide K chunk i, waits until ring slot i % STAGES is empty,
    then TMA-loads the activation tile [BLOCK_M, 64] and the weight tile [BLOCK_N, 64] into it; the
    `ready` mbarrier of the slot completes when both have landed (TMA zero-fills rows past M and
    columns past K);
  * MMA (the kernel's `num_warps` warps, one or two warpgroups): waits for slot i, issues
    `warpgroup_mma(x_tile, w_tile^T, acc)` asynchronously, waits until at most that one is in flight,
    and releases slot i - 1 (its wgmma has finished reading it). Then stores acc as bf16, masked to
    [M, N].

Row tails. A decode step of 136 rows in 64-row tiles leaves a last tile of 8 rows; a TMA box of 64 rows there
reads 56 rows past the end of x, which the TMA unit fills with zeros, and such boxes are slow: with the same
programs and the same weight bytes, a tile's cost grew with its out-of-bounds rows (2026-11-27, H100, 8B down,
128 x 64 tiles: 52.4 us at 256 rows, 96.9 at 136; 1.7B down, three row tiles: 21.6 at 384 rows, 39.3 at 272).
So the last row tile loads only the rows it has, in one or two power-of-two boxes (`row_pieces`: 8 rows as 8,
72 as 64 + 8), into the first rows of its slot; the slot's other rows keep stale values from earlier chunks. An
output row reads only its own row of x, and rows past M are never stored, so no output sees them. Same run,
full box -> tail boxes: 8B down 136 rows 96.9 -> 44.9 us (128 x 64) and 57.6 -> 44.9 (64 x 128); full tiles
within 2 %. The swapped kernel loads its second part the same way and may be as narrow as 8 rows
(wgmma's narrowest N).

Bits. Each output element is one fp32 accumulator that walks K in 64-wide chunks in increasing order,
one `warpgroup_mma` per chunk (four k=16 wgmma instructions, as `tl.dot` lowers it), zero-padded past
K, rounded once to bf16: the conditions in spirl_kernels/gemm.py's module doc, so every config here is
bitwise vLLM's `linear_batch_invariant` (tests/gpu/test_gemm.py checks each one against it). Which
warp loads a tile, and how many loads are in flight, do not enter any element's arithmetic.

Written for the Gluon API of Triton 3.6 (vLLM 0.26's pin); `_tma_load` also takes Triton 3.9's name
for the same TMA load, so the CPU tests can compile the kernel for sm_90 with either.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from spirl_kernels.gemm_tiles import BLOCK_K, tile_of
from spirl_kernels.launch import cdiv, next_power_of_2

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
"""TMA global -> shared load: `async_copy_global_to_shared` in Triton 3.6, renamed `async_load` later."""

_SMEM_PER_SM = 232448
"""Shared memory an H100 / H200 SM offers to CTAs (227 KB); each CTA also holds 1 KB for the driver."""


@triton.constexpr_function
def _mma_warps(block_m, num_warps):
    """warps_per_cta of the accumulator: warps along M (16 rows each) first, the rest along N."""
    along_m = min(num_warps, block_m // 16)
    return [along_m, num_warps // along_m]


@triton.constexpr_function
def _instr_n(block_n, num_warps, block_m):
    """wgmma's N: each warp column of the accumulator takes BLOCK_N / (warps along N) columns."""
    return block_n // (num_warps // min(num_warps, block_m // 16))


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """The ring's mbarriers, one pair per slot: `ready` (the loader's TMA bytes have landed) and `empty` (the MMA
    warps are done reading), each completed by one arrival."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def _load_rows(p1_desc, p2_desc, TWO: gl.constexpr, row, col, bar, dst, pred):
    """TMA-load rows row.. of x into the first rows of `dst` in one or two boxes (p1_desc's, then p2_desc's if TWO):
    a row tail (module doc) loads only the rows it has, not a full box mostly out of bounds."""
    P1: gl.constexpr = p1_desc.block_type.shape[0]
    _tma_load(p1_desc, [row, col], bar, dst.slice(0, P1), pred=pred)
    if TWO:
        _tma_load(p2_desc, [row + P1, col], bar, dst.slice(P1, p2_desc.block_type.shape[0]), pred=pred)


@gluon.jit
def _loader(a_desc, t1_desc, t2_desc, b_desc, a_bufs, b_bufs, ready, empty, M, off_m, off_n, k_tiles,
            TAIL: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    FULL_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    TAIL_BYTES: gl.constexpr = (t1_desc.block_type.nbytes + (TAIL - 1) * t2_desc.block_type.nbytes
                                + b_desc.block_type.nbytes)
    full = off_m + BLOCK_M <= M
    tail = off_m + BLOCK_M > M
    for i in range(k_tiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # slots start empty: the first wait passes
        if TAIL > 0:  # the last row tile loads only the rows it has (module doc: "Row tails")
            mbarrier.expect(ready.index(s), FULL_BYTES, pred=full)
            mbarrier.expect(ready.index(s), TAIL_BYTES, pred=tail)
            _tma_load(a_desc, [off_m, i * BK], ready.index(s), a_bufs.index(s), pred=full)
            _load_rows(t1_desc, t2_desc, TAIL == 2, off_m, i * BK, ready.index(s), a_bufs.index(s), tail)
        else:
            mbarrier.expect(ready.index(s), FULL_BYTES)
            _tma_load(a_desc, [off_m, i * BK], ready.index(s), a_bufs.index(s))
        _tma_load(b_desc, [off_n, i * BK], ready.index(s), b_bufs.index(s))


@gluon.jit
def _mma(a_bufs, b_bufs, ready, empty, c_ptr, M, N, stride_cm, off_m, off_n, k_tiles, num_warps: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=_mma_warps(BLOCK_M, num_warps),
                                                     instr_shape=[16, _instr_n(BLOCK_N, num_warps, BLOCK_M), 16])
    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
    for i in range(k_tiles):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)  # chunk i - 1's wgmma is done
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    ptrs = c_ptr + offs_m.to(gl.int64)[:, None] * stride_cm + offs_n[None, :]
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@gluon.jit
def _bi_matmul_ws_kernel(a_desc, t1_desc, t2_desc, b_desc, c_ptr, M, N, K, stride_cm, GROUP_M: gl.constexpr,
                         TAIL: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile per program (module doc); a_desc / b_desc: TMA boxes [BLOCK_M, 64] of x
    and [BLOCK_N, 64] of w; t1_desc, t2_desc: the boxes of x that the last row tile loads instead (`tail_pieces`),
    TAIL of them (0: M is a multiple of BLOCK_M); grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    pid_m, pid_n = tile_of(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_tiles = gl.cdiv(K, a_desc.block_type.shape[1])
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_mma, (a_bufs, b_bufs, ready, empty, c_ptr, M, N, stride_cm, off_m, off_n, k_tiles, num_warps)),
        (_loader, (a_desc, t1_desc, t2_desc, b_desc, a_bufs, b_bufs, ready, empty, M, off_m, off_n, k_tiles, TAIL)),
    ], [1], [40])


@gluon.jit
def _loader_swapped(w_desc, x1_desc, p1_desc, p2_desc, TWO: gl.constexpr, w_bufs, x1_bufs, x2_bufs, ready, empty,
                    off_n, k_tiles):
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    T1: gl.constexpr = x1_desc.block_type.shape[0]
    BYTES: gl.constexpr = (w_desc.block_type.nbytes + x1_desc.block_type.nbytes + p1_desc.block_type.nbytes
                           + TWO * p2_desc.block_type.nbytes)
    for i in range(k_tiles):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), BYTES)
        _tma_load(w_desc, [off_n, i * BK], ready.index(s), w_bufs.index(s))
        _tma_load(x1_desc, [0, i * BK], ready.index(s), x1_bufs.index(s))
        _load_rows(p1_desc, p2_desc, TWO, T1, i * BK, ready.index(s), x2_bufs.index(s), True)


@gluon.jit
def _store_transposed(acc, layout: gl.constexpr, c_ptr, M, N, stride_cm, off_n, first_row, ROWS: gl.constexpr,
                      BLOCK_W: gl.constexpr):
    n = off_n + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, layout))
    t = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(0, layout))
    gl.store(c_ptr + t.to(gl.int64)[None, :] * stride_cm + n[:, None], acc.to(c_ptr.dtype.element_ty),
             mask=(t[None, :] < M) & (n[:, None] < N))


@gluon.jit
def _mma_swapped(w_bufs, x1_bufs, x2_bufs, ready, empty, c_ptr, M, N, stride_cm, off_n, k_tiles,
                 num_warps: gl.constexpr):
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BLOCK_W: gl.constexpr = w_bufs.type.shape[1]
    T1: gl.constexpr = x1_bufs.type.shape[1]
    T2: gl.constexpr = x2_bufs.type.shape[1]
    l1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, T1, 16])
    l2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, T2, 16])
    acc1 = gl.zeros((BLOCK_W, T1), gl.float32, l1)
    acc2 = gl.zeros((BLOCK_W, T2), gl.float32, l2)
    for i in range(k_tiles):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        acc1 = warpgroup_mma(w_bufs.index(s), x1_bufs.index(s).permute((1, 0)), acc1, is_async=True)
        acc2 = warpgroup_mma(w_bufs.index(s), x2_bufs.index(s).permute((1, 0)), acc2, is_async=True)
        acc1, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc1, acc2))  # chunk i - 1's two are done
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
    acc1, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, acc2))
    _store_transposed(acc1, l1, c_ptr, M, N, stride_cm, off_n, 0, T1, BLOCK_W)
    _store_transposed(acc2, l2, c_ptr, M, N, stride_cm, off_n, T1, T2, BLOCK_W)


@gluon.jit
def _bi_matmul_ws_swapped_kernel(w_desc, x1_desc, p1_desc, p2_desc, c_ptr, M, N, K, stride_cm, T2: gl.constexpr,
                                 TWO: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """C^T = W X^T, one program per BLOCK_W weight rows and every row of x (at most T1 + T2), so each weight byte
    is read once: x's rows in two parts, T1 (x1_desc's box, from row 0) and T2 (from row T1, only the rows there
    are: p1_desc's box and, if TWO, p2_desc's, `row_pieces`), two accumulators [BLOCK_W, T1] and [BLOCK_W, T2]
    fed by the same weight chunk (a decode step of 129-192 rows is 128 + 8/16/32/64, no padding to 256: Gluon's
    tensors, like Triton's, have power-of-two shapes). The operands' roles are swapped as in spirl_kernels/gemm.py's
    `_bi_matmul_swap_kernel`, which gives vLLM's bits; each element is still one K loop in order, one
    `warpgroup_mma` per 64-wide chunk."""
    BLOCK_W: gl.constexpr = w_desc.block_type.shape[0]
    off_n = gl.program_id(0) * BLOCK_W
    k_tiles = gl.cdiv(K, w_desc.block_type.shape[1])
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    x1_bufs = gl.allocate_shared_memory(x1_desc.dtype, [STAGES] + x1_desc.block_type.shape, x1_desc.layout)
    x2_bufs = gl.allocate_shared_memory(p1_desc.dtype, [STAGES, T2, p1_desc.block_type.shape[1]], p1_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_mma_swapped, (w_bufs, x1_bufs, x2_bufs, ready, empty, c_ptr, M, N, stride_cm, off_n, k_tiles, num_warps)),
        (_loader_swapped, (w_desc, x1_desc, p1_desc, p2_desc, TWO, w_bufs, x1_bufs, x2_bufs, ready, empty, off_n,
                           k_tiles)),
    ], [1], [40])


def token_parts(rows: int) -> tuple[int, int]:
    """(T1, T2) for a swapped launch over `rows` rows of x: power-of-two parts covering them, the first at least 16
    and at most 128, the second at least 8 (wgmma's narrowest N; module doc: "Row tails"); at most 192 rows: T2 up
    to 64, whose accumulator fits the registers beside T1's."""
    t1 = 128 if rows > 128 else max(16, next_power_of_2(rows))
    return t1, max(8, next_power_of_2(rows - t1)) if rows > t1 else 8


def matmul_swapped_into(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, rows_per_launch: int, block_w: int,
                        num_warps: int, stages: int) -> None:
    """c = a @ w.T with `_bi_matmul_ws_swapped_kernel`, `rows_per_launch` (at most 192) rows of a per launch (an
    output row's arithmetic reads only its own row of a, so the split does not enter the bits)."""
    m, k = a.shape
    n = w.shape[0]
    w_d = _descriptor(w, block_w)
    for lo in range(0, m, rows_per_launch):
        x, out = a[lo:lo + rows_per_launch], c[lo:lo + rows_per_launch]
        t1, t2, p1, p2, two = swapped_boxes(x.shape[0])
        d = {r: _descriptor(x, r) for r in {t1, p1, p2}}
        _bi_matmul_ws_swapped_kernel[(cdiv(n, block_w),)](w_d, d[t1], d[p1], d[p2], out, x.shape[0], n, k,
                                                           out.stride(0), t2, two, stages, num_warps=num_warps)


def swapped_boxes(rows: int) -> tuple[int, int, int, int, bool]:
    """A swapped launch over `rows` rows of x: (T1, T2, P1, P2, TWO): its two parts (`token_parts`), and the one or
    two TMA boxes that load the second part's rows (`row_pieces`; P2 is P1 again where one box does, TWO False)."""
    t1, t2 = token_parts(rows)
    p1, p2 = row_pieces(max(1, rows - t1))
    return t1, t2, p1, p2 or p1, bool(p2)


def row_pieces(rows: int) -> tuple[int, int]:
    """TMA boxes (P1, P2) that load `rows` rows with few rows out of bounds (module doc: "Row tails"): the largest
    power of two up to `rows`, then the power of two covering the rest (0 if none), each at least 8 rows (TMA's
    128-byte swizzle atom); 72 rows load as 64 + 8, 24 as 16 + 8, 56 as 32 + 32."""
    p1 = max(8, 1 << (rows.bit_length() - 1))
    return p1, (max(8, next_power_of_2(rows - p1)) if rows > p1 else 0)


def tail_pieces(m: int, block_m: int) -> tuple[int, int]:
    """`row_pieces` of the rows m leaves past its last full BLOCK_M tile, (0, 0) if none."""
    return row_pieces(m % block_m) if m % block_m else (0, 0)


def tail_boxes(m: int, block_m: int) -> tuple[int, int, int]:
    """`_bi_matmul_ws_kernel`'s TAIL, t1_desc's and t2_desc's box rows for a launch over m rows: the boxes of
    `tail_pieces` (TAIL of them; an unused one repeats the one before, BLOCK_M where there is no tail)."""
    p1, p2 = tail_pieces(m, block_m)
    return (p1 > 0) + (p2 > 0), p1 or block_m, p2 or p1 or block_m


def _descriptor(t: torch.Tensor, rows: int):
    """A TMA descriptor of t (row-major) with [rows, BLOCK_K] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [rows, BLOCK_K], _layout(rows))


def smem_bytes(block_m: int, block_n: int, stages: int) -> int:
    """Shared memory of one program: the ring of bf16 tiles (the barriers are a few bytes)."""
    return stages * (block_m + block_n) * BLOCK_K * 2


def max_registers(block_m: int, block_n: int, stages: int) -> int | None:
    """`maxnreg` for the launch: 128 where two programs fit an SM's shared memory, so that their registers
    (8 warps each: the MMA warpgroup and the loader's) fit too; else the compiler's default (one program)."""
    return 128 if 2 * (smem_bytes(block_m, block_n, stages) + 2048) <= _SMEM_PER_SM else None


def runs_on(device: torch.device) -> bool:
    """These kernels are built for Hopper (sm_90): wgmma, and TMA driven by a producer warp."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _layout(rows: int):
    return gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl.bfloat16)


def matmul_into(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, block_m: int, block_n: int, group_m: int,
                num_warps: int, stages: int) -> None:
    """c[M, N] = a[M, K] @ w[N, K].T on the tile (block_m, block_n) with `stages` K chunks in flight."""
    m, k = a.shape
    n = w.shape[0]
    tail, r1, r2 = tail_boxes(m, block_m)
    d = {r: _descriptor(a, r) for r in {block_m, r1, r2}}
    w_d = _descriptor(w, block_n)
    extra = {}
    regs = max_registers(block_m, block_n, stages)
    if regs:
        extra["maxnreg"] = regs
    grid = (cdiv(m, block_m) * cdiv(n, block_n),)
    _bi_matmul_ws_kernel[grid](d[block_m], d[r1], d[r2], w_d, c, m, n, k, c.stride(0), group_m, tail, stages,
                               num_warps=num_warps, **extra)


def _compile_sm90(kernel, signature: dict, constexprs: dict, aligned_args: tuple, num_warps: int):
    """`kernel` compiled for sm_90 without a GPU, with the 16-byte divisibility hints a real launch gives
    `aligned_args` (argument positions); without them the compiled code is not what runs."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    aligned = [["tt.divisibility", 16]]
    src = GluonASTSource(kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs,
                         attrs={(i,): aligned for i in aligned_args})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def _descriptor_type(rows: int) -> str:
    return f"tensordesc<bf16[{rows}, {BLOCK_K}],{_layout(rows)!r}>"


_SCALARS = {"c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32"}


def compile_sm90(block_m: int, block_n: int, group_m: int, num_warps: int, stages: int, rows: int = 0):
    """`_bi_matmul_ws_kernel` compiled for sm_90 without a GPU (for CPU tests), as a launch over `rows` rows of x
    runs it (its row tail's boxes, `tail_pieces`; none by default): Triton's CompiledKernel."""
    tail, r1, r2 = tail_boxes(rows, block_m)
    return _compile_sm90(_bi_matmul_ws_kernel, {"a_desc": _descriptor_type(block_m), "t1_desc": _descriptor_type(r1),
                                                "t2_desc": _descriptor_type(r2), "b_desc": _descriptor_type(block_n),
                                                **_SCALARS},
                         {"GROUP_M": group_m, "TAIL": tail, "STAGES": stages, "num_warps": num_warps},
                         (4, 6, 7, 8), num_warps)


def compile_swapped_sm90(block_w: int, rows: int, num_warps: int, stages: int):
    """`_bi_matmul_ws_swapped_kernel` compiled for sm_90 without a GPU (for CPU tests), as a launch over `rows`
    (at most 192) rows of x runs it."""
    t1, t2, p1, p2, two = swapped_boxes(rows)
    descriptors = {"w_desc": block_w, "x1_desc": t1, "p1_desc": p1, "p2_desc": p2}
    return _compile_sm90(_bi_matmul_ws_swapped_kernel,
                         {**{name: _descriptor_type(r) for name, r in descriptors.items()}, **_SCALARS},
                         {"T2": t2, "TWO": two, "STAGES": stages, "num_warps": num_warps}, (4, 6, 7, 8), num_warps)
