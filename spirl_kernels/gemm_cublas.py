"""The engine's batch-invariant GEMM: cuBLAS wherever it is seen to give `spirl_kernels.gemm`'s bits, else `spirl_kernels.gemm`.

    y = matmul(x, w)      x [..., K] bf16, w [N, K] bf16, y [..., N]: bitwise `spirl_kernels.gemm.matmul(x, w)`

Why cuBLAS can: vLLM 0.26's batch-invariant mode sets cuBLAS up on Hopper without split-K (its
`enable_batch_invariant_mode`: a 1 KiB cuBLASLt workspace, no reduced-precision reductions, cuBLASLt). Each output
element is then one fp32 accumulator fed by the tensor cores' MMAs in K order and rounded once to bf16, which is
what vLLM's Triton kernel computes (spirl_kernels/gemm.py's module doc), whatever tiles cuBLAS picks. Measured on an H100
(2026-11-28, torch 2.11.0+cu130's cuBLAS, `6396e11:compare/bench_gemm.py --bits-only --cublas-as-vllm`): bitwise equal
to vLLM's `linear_batch_invariant` in 11,520 of 11,520 (layer, rows) cases at each of Qwen3-1.7B and Qwen3-8B (every
linear; rows 1-2,048 and every 24th to 8,176). Why it should: at 65-512 rows, a decode step's sizes, cuBLAS was
up to 1.7x faster than the best Triton tile (`--graph`: 8B gate_up at 272 rows 87 us against 130, 1.7B gate_up
at 272 rows 25 against 43; 6396e11:docs/rollout-profile.md, issue 39, 2026-11-28).

Why it is checked, not assumed: which algorithm cuBLAS runs is its heuristic's choice for each problem (sizes,
strides, alignment, workspace, GPU, library version), none of which SPIRL pins, and a split-K or two-level
accumulation would change bits. So each problem (M, N, K, device) is checked the first time `matmul` meets it
outside CUDA-graph capture: cuBLAS and `spirl_kernels.gemm` run on a random x of that shape (a private generator: no
RNG state of the caller's moves) and the call's own weight, and cuBLAS is used for that problem from then on only
if `torch.equal` holds; otherwise `spirl_kernels.gemm`, logged once. Inside capture an unchecked problem runs
`spirl_kernels.gemm` (vLLM runs each graph's step once eagerly before capturing it: `cudagraph_num_of_warmups` 1). Only
row-major x and w with 16-byte aligned rows and addresses go to cuBLAS (the layout checked); others run
`spirl_kernels.gemm`. The trainer keeps `spirl_kernels.gemm` (its products are thousands of rows, where the Triton kernel took
0.95-1.14x cuBLAS's time), so the trainer's bits are the engine's by the check above.

Where `spirl_kernels.gemm` stays although cuBLAS would give its bits (`keep_triton`): products of more than 2,048 rows
(Triton 0.95-1.14x cuBLAS's time there; no check during vLLM's memory profile) and lm_head above 512 rows. Where
the faster of the two depends on the GPU (`timed`: lm_head at 1-64 rows), the check also times both on the GPU it
runs on and cuBLAS is used only if it was faster there (`_gpu_us`).
Off Hopper (capability 9.x) everything runs `spirl_kernels.gemm`: cuBLAS's bits and speed were measured only there.
`SPIRL_GEMM_CUBLAS=0` turns cuBLAS off (to time the Triton-only engine; the bits are the same).
"""

from __future__ import annotations

import logging
import os

import torch

from spirl_kernels import gemm

_log = logging.getLogger(__name__)

CUBLAS, OTHER_BITS, TRITON_FASTER = "cublas", "other_bits", "triton_faster"
"""What a check found for a product: cuBLAS gave spirl_kernels.gemm's bits (and, where `timed`, was faster); cuBLAS gave
other bits; cuBLAS gave the same bits but was slower on this GPU (`timed` products only)."""

_checked: dict[tuple, str] = {}
"""(M, N, K, device) -> what the check found (CUBLAS, OTHER_BITS, TRITON_FASTER): at most MAX_ROWS x the model's
linear shapes. Only CUBLAS runs cuBLAS."""

_timings: dict[tuple, tuple[float, float]] = {}
"""(M, N, K, device) -> (cuBLAS, spirl_kernels.gemm) microseconds a call, for the `timed` products checked so far."""

_generators: dict[torch.device, torch.Generator] = {}

_enabled: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """cuBLAS is tried on this device: a Hopper GPU (where it was measured) and SPIRL_GEMM_CUBLAS not 0 (both read
    on the device's first call)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    on = _enabled.get(index)
    if on is None:
        on = _enabled[index] = (os.environ.get("SPIRL_GEMM_CUBLAS", "1") != "0"
                                and torch.cuda.get_device_capability(index)[0] == 9)
    return on


MAX_ROWS = 2048
"""Most rows a product may have to go to cuBLAS: the engine's largest CUDA-graph step (spirl.engines.vllm_engine.
GRAPH_MAX_TOKENS). Above it (eager prefills, vLLM's 16,384-token profile run) the Triton kernel took 0.95-1.14x
cuBLAS's time (1.7B and 8B, every linear, at 2,048, 4,096 and 8,192 rows), and a check there would hold two outputs
of up to 16,384 rows at once during vLLM's memory profile: the engine's KV cache measured 0.65 GiB
smaller (4,416-4,560 of 8B's tokens) with checks at every size."""


VOCAB_WIDE = 65536
"""Outputs wider than this are vocabulary-wide (lm_head; Qwen3's is 151,936): `keep_triton` and `timed` rules."""

TIMED_ROWS = 64
"""Most rows of a `timed` product."""


def keep_triton(m: int, n: int, k: int) -> bool:
    """Products left on `spirl_kernels.gemm` although cuBLAS would give its bits (H100, `6396e11:compare/bench_gemm.py
    --graph --cublas-as-vllm`, 2026-11-28): more than MAX_ROWS rows; and vocabulary-wide outputs above 512 rows: at
    1,024 rows the Triton kernel took 0.98x (8B) and 1.05x (1.7B) cuBLAS's time, and vLLM's sampler warm-up runs
    lm_head on max_num_seqs rows (1,024 by default) during its memory profile. At 65-512 rows cuBLAS was up to 1.36x
    faster on the H100 (at 1-64 rows see `timed`)."""
    return m > MAX_ROWS or (n > VOCAB_WIDE and m > 512)


def timed(m: int, n: int, k: int) -> bool:
    """Products where the faster of cuBLAS and `spirl_kernels.gemm` is measured on the GPU at hand, at the check: lm_head
    at 1-64 rows. There the GPUs disagree (`6396e11:compare/bench_gemm.py --layers lm_head --graph --cublas-as-vllm`):
    on an H100 the swapped-operand Triton kernel was 2-7 % faster than cuBLAS (2026-11-28: 8B 407-445 us against
    436-454, 1.7B 205-229 against 219-234), on an H200 0-17 % slower (2026-11-28: 1.7B at 1 / 2 / 8 rows 157.8 /
    167.7 / 169.2 us against 144.4 / 145.9 / 146.8; 8B at 32 / 64 rows 324.5 / 349.1 against 295.2 / 298.8). Timed this way
    at every row count 1-64 on an H200 (2026-11-28, tests/gpu/test_gemm_cublas_gpu.py): cuBLAS faster at all 64 at 1.7B
    (149-160 us against 160-183), at 2-64 at 8B (296-311 against 306-349), spirl_kernels.gemm at 8B's 1 row (291 against
    296); the engine then picks per row count on whichever GPU it runs."""
    return n > VOCAB_WIDE and m <= TIMED_ROWS  # never kept on Triton (keep_triton: above 512 rows)


def _layout_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Dense rows (the row stride is K: the check's key holds no stride) that are 16-byte aligned (`gemm._tma_ok`)."""
    return a.dim() == w.dim() == 2 and a.stride(0) == a.shape[1] and w.stride(0) == w.shape[1] and gemm._tma_ok(a, w)


def _cublas(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, w.t())


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _random_rows(m: int, k: int, like: torch.Tensor) -> torch.Tensor:
    gen = _generators.get(like.device)  # a tensor's device: with its index
    if gen is None:
        gen = _generators[like.device] = torch.Generator(device=like.device)
        gen.manual_seed(0)
    return torch.randn(m, k, device=like.device, dtype=like.dtype, generator=gen)


HOLD_CYCLES = 4_000_000
"""GPU clock cycles `torch.cuda._sleep` holds the stream before a timed batch of calls (about 2 ms on an H100 or
H200): longer than the host takes to queue TIMING_CALLS launches (Triton's up to about 90 us each), so the batch
runs back to back and its events measure GPU time only, whatever the host's load. (`torch.cuda._sleep` is torch's
own spin kernel for this, private but long-standing; its tests use it the same way.)"""

TIMING_CALLS = 5
TIMING_ROUNDS = 3
"""A timed product runs TIMING_CALLS calls of each kernel per round, the two alternating, for TIMING_ROUNDS rounds;
each kernel's best round counts. Measured on an H200 (2026-11-28, 6396e11:docs/rollout-profile.md): 18.8 ms a row count
at Qwen3-1.7B's lm_head and 22.4 ms at 8B's (0.6 / 0.9 ms for the bit check alone), once per process: 1.2 / 1.4 s
for a run that meets every row count 1-64."""


def _gpu_us(fn, calls: int = TIMING_CALLS) -> float:
    """GPU microseconds a call of fn (queued behind a held stream: HOLD_CYCLES)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(HOLD_CYCLES)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls


def _time_both(probe: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """(cuBLAS, spirl_kernels.gemm) microseconds a call on this product on this GPU, each its best of TIMING_ROUNDS."""
    cublas, triton = [], []
    for _ in range(TIMING_ROUNDS):
        cublas.append(_gpu_us(lambda: _cublas(probe, w)))
        triton.append(_gpu_us(lambda: gemm.matmul(probe, w)))
    return min(cublas), min(triton)


def _check(a: torch.Tensor, w: torch.Tensor) -> str | None:
    """What cuBLAS does for a's shape with weight w (CUBLAS, OTHER_BITS or, for a `timed` product, TRITON_FASTER);
    None when that cannot be told (spirl_kernels.gemm's output all zero: a zero weight, as before a checkpoint is loaded,
    proves nothing)."""
    m, k = a.shape
    n = w.shape[0]
    probe = _random_rows(m, k, a)
    ref = gemm.matmul(probe, w)
    if not torch.any(ref):
        return None
    if not torch.equal(_cublas(probe, w), ref):
        _log.warning("spirl_kernels.gemm_cublas: cuBLAS gave other bits than the batch-invariant kernel for [%d x %d] @ "
                     "[%d x %d]; that product runs spirl_kernels.gemm (same bits as vLLM's, slower)", m, k, k, n)
        return OTHER_BITS
    if not timed(m, n, k):
        return CUBLAS
    us = _timings[(m, n, k, a.device)] = _time_both(probe, w)
    found = CUBLAS if us[0] < us[1] else TRITON_FASTER
    _log.info("spirl_kernels.gemm_cublas: [%d x %d] @ [%d x %d] takes %.1f us on cuBLAS, %.1f on spirl_kernels.gemm: %s", m, k, k,
              n, us[0], us[1], "cuBLAS" if found == CUBLAS else "spirl_kernels.gemm")
    return found


def use_cublas(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `matmul` runs this 2-D product on cuBLAS: enabled, not left on Triton (`keep_triton`), the
    layout it was checked in, and the problem checked equal (and, where `timed`, faster; checked now if it is new and
    we are not capturing a CUDA graph)."""
    m, k = a.shape
    n = w.shape[0]
    if torch.compiler.is_compiling():  # traced once for every M (vLLM's piecewise mode): the Triton kernel
        return False
    if not (enabled(a.device) and not keep_triton(m, n, k) and a.dtype == w.dtype == torch.bfloat16
            and _layout_ok(a, w)):
        return False
    key = (m, n, k, a.device)
    found = _checked.get(key)
    if found is None:
        if _capturing():
            return False  # unchecked: the Triton kernel, whose bits are known
        found = _check(a, w)
        if found is None:
            return False
        _checked[key] = found
    return found == CUBLAS


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K].T -> [..., N], bitwise `spirl_kernels.gemm.matmul(x, w)` (vLLM's batch-invariant linear);
    on cuBLAS where `use_cublas` says so."""
    a = x.reshape(-1, x.shape[-1])
    if a.shape[0] == 0 or a.shape[1] != w.shape[-1] or not use_cublas(a, w):
        return gemm.matmul(x, w)
    return _cublas(a, w).reshape(*x.shape[:-1], w.shape[0])


def checked() -> dict[str, int]:
    """How many problems were checked, by what was found (CUBLAS, OTHER_BITS, TRITON_FASTER: for logs and
    benchmarks)."""
    found = list(_checked.values())
    return {name: found.count(name) for name in (CUBLAS, OTHER_BITS, TRITON_FASTER)}
