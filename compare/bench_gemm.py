"""The batch-invariant GEMM (kernels/gemm.py): bitwise check against vLLM's kernel, and tile tuning.

    VLLM_BATCH_INVARIANT=1 python compare/bench_gemm.py [--shape Qwen3-1.7B] [--layers o,down] [--graph] [--json OUT]

For every linear of the shape (qkv, o, gate_up, down, lm_head) and row counts from decode (1, 8,
64) to training (8192), runs every config of `kernels.gemm.CONFIGS` on the same random bf16
inputs and checks its output is bitwise equal (torch.equal) to vLLM 0.26's
`linear_batch_invariant`; then times each next to vLLM's kernel and cuBLAS (torch.mm, what a plain
bf16 model runs), and prints the fastest config per shape and whether cuBLAS gave vLLM's bits
(`--cublas-as-vllm`: with cuBLAS set up as vLLM's batch-invariant mode sets it up on Hopper).

Timing: by default triton.testing.do_bench (median, L2 flushed), which times launches from Python.
A GEMM of tens of microseconds then measures the host too: making TMA descriptors and launching took
70-90 us per call on an H100 host (session 42), more than the kernel. `--graph` times what a decode
step runs instead: the launches replayed from one CUDA graph (vLLM captures its decode steps), each
launch on another copy of the weight so that the copies together exceed L2 and every launch reads its
weight from HBM, as a step's layers do.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from compare.rollout_sweep import parse_ints  # noqa: E402

ROWS = (1, 8, 64, 128, 256, 512, 2048, 8192)


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of a weights.py shape's GEMMs by name (weights_vllm_compat.linear_shapes)."""
    import weights_vllm_compat
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

    return weights_vllm_compat.linear_shapes(model_args_from_hf_config(hf_config_for_shape(shape)))


def chosen_layers(parser, shape: str, spec: str | None) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """(`layer_shapes(shape)`, the names a --layers comma list picks: all by default); an unknown name is the
    parser's one-line error."""
    shapes = layer_shapes(shape)
    layers = spec.split(",") if spec else list(shapes)
    if set(layers) - set(shapes):
        parser.error(f"unknown --layers {sorted(set(layers) - set(shapes))}; {shape} has {', '.join(shapes)}")
    return shapes, layers


def graph_us(call, weights: list, reps: int = 10, replays: int = 5) -> float:
    """Median microseconds per `call(w)`, the launches replayed from one CUDA graph: `reps` rounds over
    `weights` (copies of one weight), after a warm-up outside capture (compiles, allocations)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in weights:
            call(w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for w in weights:
                call(w)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(weights)))
    del graph
    return sorted(times)[len(times) // 2]


def weight_copies(w: torch.Tensor, over_bytes: int) -> list:
    """w and copies of it, together more than `over_bytes` (three times L2), so a launch's weight is not
    still in L2 from the launch before."""
    n = -(-over_bytes // (w.numel() * w.element_size()))
    return [w] + [w.clone() for _ in range(n - 1)]


def spans(values: list[int]) -> str:
    """Sorted integers as runs: [1, 2, 3, 8, 10, 11] -> "1-3,8,10-11"."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def main(argv=None) -> int:
    import triton
    from triton.runtime.errors import OutOfResources
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    from kernels import gemm

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="Qwen3-1.7B")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts: integers and ranges, e.g. 1-320,2064")
    p.add_argument("--configs", help="comma list of kernels.gemm.CONFIGS names (default: all)")
    p.add_argument("--layers", help="comma list of the shape's GEMMs to run (default: all of qkv, o, gate_up, "
                                    "down, lm_head)")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench's timing window per case")
    p.add_argument("--graph", action="store_true",
                   help="time launches replayed from a CUDA graph, weights from HBM (module doc), not do_bench's")
    p.add_argument("--cublas-as-vllm", action="store_true",
                   help="set cuBLAS up as vLLM's batch-invariant mode does on Hopper (its enable_batch_invariant_mode: "
                        "no split-K through a 1 KiB cuBLASLt workspace, no reduced-precision reductions, cuBLASLt) "
                        "before any GEMM, so that the cublas columns time and check that cuBLAS")
    p.add_argument("--bits-only", action="store_true",
                   help="check bits (every config, vLLM's kernel, cuBLAS) without timing anything: a sweep of many "
                        "row counts")
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = parse_ints(args.rows, "--rows")
    if args.cublas_as_vllm:  # before the first cuBLAS handle: its workspace settings are read when it is made
        from vllm.model_executor.layers.batch_invariant import enable_batch_invariant_mode

        enable_batch_invariant_mode()
    configs = args.configs.split(",") if args.configs else list(gemm.CONFIGS)
    unknown = [c for c in configs if c not in gemm.CONFIGS]
    if unknown:
        p.error(f"unknown --configs {unknown}; known: {', '.join(gemm.CONFIGS)}")
    shapes, layers = chosen_layers(p, args.shape, args.layers)
    do_bench = lambda f: triton.testing.do_bench(f, warmup=max(5, args.rep_ms // 4), rep=args.rep_ms,
                                                 return_mode="median") * 1e3
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    per_config_mismatch = dict.fromkeys(configs, 0)
    cublas_same = cublas_cases = 0
    cublas_other: dict[str, list[int]] = {}
    did_not_fit, picks = set(), set()
    torch.manual_seed(0)
    results = []
    for name in layers:
        n, k = shapes[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        ws = weight_copies(w, 3 * l2) if args.graph else [w]
        bench = ((lambda call: float("nan")) if args.bits_only else (lambda call: graph_us(call, ws)) if args.graph
                 else (lambda call: do_bench(lambda: call(w))))
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = linear_batch_invariant(x, w)
            row = {"layer": name, "M": m, "N": n, "K": k}
            picked = gemm.pick_config(m, n, k)
            picks.add(picked)
            for cfg in dict.fromkeys([*configs, picked]):
                try:
                    y = gemm.matmul(x, w, cfg)
                except OutOfResources as e:  # a candidate tile too big for this GPU's shared memory: not run
                    print(f"{name} M={m} {cfg} did not run: {e}", flush=True)
                    row[f"{cfg}_equal"], row[f"{cfg}_us"] = None, float("inf")
                    did_not_fit.add(cfg)
                    continue
                same = torch.equal(y, ref)
                per_config_mismatch[cfg] = per_config_mismatch.get(cfg, 0) + (not same)
                row[f"{cfg}_equal"] = same
                row[f"{cfg}_us"] = bench(lambda w_: gemm.matmul(x, w_, cfg))
            row["picked"] = picked
            row["vllm_kernel_us"] = bench(lambda w_: linear_batch_invariant(x, w_))
            row["cublas_us"] = bench(lambda w_: torch.mm(x, w_.t()))
            row["cublas_equal"] = torch.equal(torch.mm(x, w.t()), ref)  # information: cuBLAS is not a config
            cublas_same, cublas_cases = cublas_same + row["cublas_equal"], cublas_cases + 1
            if not row["cublas_equal"]:
                cublas_other.setdefault(name, []).append(m)
            results.append(row)
            if args.bits_only:
                print(f"{name:8s} M={m:5d} N={n:6d} K={k:5d}  configs all equal: "
                      f"{all(row[f'{c}_equal'] is not False for c in configs)}  cublas equal: {row['cublas_equal']}",
                      flush=True)
                continue
            best = min(configs, key=lambda c: row[f"{c}_us"])
            row["best"] = best
            print(f"{name:8s} M={m:5d} N={n:6d} K={k:5d}  vllm {row['vllm_kernel_us']:8.1f}us  "
                  f"best {best:10s} {row[best + '_us']:8.1f}us  picked {row['picked']:10s} "
                  f"{row[row['picked'] + '_us']:8.1f}us  cublas {row['cublas_us']:8.1f}us "
                  f"({'vLLM bits' if row['cublas_equal'] else 'other bits'})  "
                  f"{n * k * 2 / row[best + '_us'] / 1e6:5.2f} TB/s  all equal: "
                  f"{all(row[f'{c}_equal'] is not False for c in configs)}", flush=True)
            print("   " + "  ".join(f"{c} {row[c + '_us']:.1f}" for c in configs), flush=True)
    mismatches = sum(per_config_mismatch.values())
    print(f"bitwise mismatches vs vLLM's kernel: {mismatches} (config, shape) cases; per config: "
          + ", ".join(f"{c} {v}" for c, v in per_config_mismatch.items())
          + (f"; did not run (shared memory): {', '.join(sorted(did_not_fit))}" if did_not_fit else ""))
    print(f"cuBLAS ({'set up as vLLM batch-invariant mode on Hopper' if args.cublas_as_vllm else 'torch defaults'}) "
          f"bitwise equal to vLLM's kernel in {cublas_same} of {cublas_cases} (layer, rows) cases"
          + "".join(f"; other bits: {layer} at rows {spans(ms)}" for layer, ms in cublas_other.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if mismatches == 0 and not did_not_fit & picks else 1  # a picked config must fit and match


if __name__ == "__main__":
    sys.exit(main())
