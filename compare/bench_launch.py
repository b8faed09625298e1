"""Host time of one eager GEMM launch: this project's batch-invariant GEMM against cuBLAS, side by side.

    VLLM_BATCH_INVARIANT=1 python compare/bench_launch.py [--shape Qwen3-1.7B] [--rows 128,257,4112] [--json OUT]

Why: a decode step's layers replay a CUDA graph, but vLLM computes the logits (lm_head) outside it, once per
step, and a prefill longer than the largest captured graph launches every kernel from Python. There the
host's time per launch is what a step waits for when it exceeds the kernel's (session 46: an eager 2,064-token
prefill at Qwen3-8B took 62-68 ms of host time against 53 ms of kernels; plain vLLM 21-38 ms).

For each GEMM of the shape and row count, the median host microseconds of one call (time from call to return,
launches not synchronized; a short burst per sample so the GPU's launch queue never fills and blocks the host)
of: SPIRL's engine path (vLLM's `linear_batch_invariant` as `spirl.numerics.vllm_patches` rebinds it, with the
weight held as vLLM's `ModelWeightParameter`, whose Python `__torch_function__` every attribute read goes
through), the same GEMM on a plain tensor (`kernels.gemm.matmul`, what the trainer runs), and plain vLLM's path,
`torch.nn.functional.linear` (cuBLAS) on the same parameter; then the kernels' GPU microseconds (CUDA events over
the same burst), so a reader sees whether the host or the GPU bounds that launch. The first call of each is
outside the timing (compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from compare.bench_gemm import chosen_layers  # noqa: E402
from compare.rollout_sweep import parse_ints  # noqa: E402


def host_us(call, burst: int = 8, samples: int = 40) -> tuple[float, float]:
    """(median host us of one `call()`, GPU us of one call): `samples` bursts of `burst` calls, each call timed
    on the host (perf_counter) and each burst on the GPU (events), synchronized between bursts only."""
    call()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(burst):
            t = time.perf_counter_ns()
            call()
            host.append((time.perf_counter_ns() - t) / 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3 / burst)
    return statistics.median(host), statistics.median(gpu)


def vllm_parameter(w: torch.Tensor) -> torch.Tensor:
    """w as vLLM 0.26's engine holds a linear layer's weight (`ModelWeightParameter`, a Parameter subclass with a
    Python `__torch_function__`)."""
    from vllm.model_executor.parameter import ModelWeightParameter

    return ModelWeightParameter.__new__(ModelWeightParameter, data=w)  # its __init__ needs vLLM's parallel groups


def main(argv=None) -> int:
    from kernels import gemm
    from spirl.numerics import vllm_patches

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="Qwen3-1.7B")
    p.add_argument("--rows", default="1,128,200,256,257,320,2064,4112", help="row counts: integers and ranges")
    p.add_argument("--layers", help="comma list of the shape's GEMMs (default: all, lm_head included)")
    p.add_argument("--json", help="write the rows as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it times kernel launches)")
    shapes, layers = chosen_layers(p, args.shape, args.layers)
    rows = parse_ints(args.rows, "--rows")
    vllm_patches.apply()
    import vllm.model_executor.layers.linear as vllm_linear

    engine_gemm = vllm_linear.linear_batch_invariant  # the patched function vLLM's linear layers call
    torch.manual_seed(0)
    results = []
    for name in layers:
        n, k = shapes[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wp = vllm_parameter(w)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            engine, ours_gpu = host_us(lambda: engine_gemm(x, wp))
            ours, _ = host_us(lambda: gemm.matmul(x, w))
            cublas, cublas_gpu = host_us(lambda: torch.nn.functional.linear(x, wp))
            row = {"shape": args.shape, "layer": name, "M": m, "N": n, "K": k, "config": gemm.pick_config(m, n, k),
                   "engine_host_us": round(engine, 1), "matmul_host_us": round(ours, 1),
                   "cublas_param_host_us": round(cublas, 1), "ours_gpu_us": round(ours_gpu, 1),
                   "cublas_gpu_us": round(cublas_gpu, 1)}
            results.append(row)
            print(f"{name:8s} M={m:5d} {row['config']:15s} host us: SPIRL engine {engine:6.1f}  matmul {ours:6.1f}"
                  f"  plain vLLM (cuBLAS) {cublas:6.1f}  ratio {engine / cublas:5.2f}x   gpu us: ours {ours_gpu:8.1f}"
                  f"  cuBLAS {cublas_gpu:8.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
