"""The batch-invariant GEMM (kernels/gemm.py): bitwise check against vLLM's kernel, and tile tuning.

    VLLM_BATCH_INVARIANT=1 python compare/bench_gemm.py [--shape Qwen3-1.7B] [--json OUT]

For every linear of the shape (qkv, o, gate_up, down, lm_head) and row counts from decode (1, 8,
64) to training (8192), runs every config of `kernels.gemm.CONFIGS` on the same random bf16
inputs and checks its output is bitwise equal (torch.equal) to vLLM 0.26's
`linear_batch_invariant`; then times each (triton.testing.do_bench, median) next to vLLM's kernel
and cuBLAS (torch.mm, what a plain bf16 model runs), and prints the fastest config per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

ROWS = (1, 8, 64, 128, 256, 512, 2048, 8192)


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of a weights.py shape's GEMMs by name (weights_vllm_compat.linear_shapes)."""
    import weights_vllm_compat
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

    return weights_vllm_compat.linear_shapes(model_args_from_hf_config(hf_config_for_shape(shape)))


def main(argv=None) -> int:
    import triton
    from triton.runtime.errors import OutOfResources
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    from kernels import gemm

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="Qwen3-1.7B")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--configs", help="comma list of kernels.gemm.CONFIGS names (default: all)")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench's timing window per case")
    p.add_argument("--json")
    args = p.parse_args(argv)
    configs = args.configs.split(",") if args.configs else list(gemm.CONFIGS)
    unknown = [c for c in configs if c not in gemm.CONFIGS]
    if unknown:
        p.error(f"unknown --configs {unknown}; known: {', '.join(gemm.CONFIGS)}")
    bench = lambda f: triton.testing.do_bench(f, warmup=max(5, args.rep_ms // 4), rep=args.rep_ms,
                                              return_mode="median") * 1e3
    per_config_mismatch = dict.fromkeys(configs, 0)
    did_not_fit, picks = set(), set()
    torch.manual_seed(0)
    results = []
    for name, (n, k) in layer_shapes(args.shape).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in map(int, args.rows.split(",")):
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
                row[f"{cfg}_us"] = bench(lambda: gemm.matmul(x, w, cfg))
            row["picked"] = picked
            row["vllm_kernel_us"] = bench(lambda: linear_batch_invariant(x, w))
            row["cublas_us"] = bench(lambda: torch.mm(x, w.t()))
            best = min(configs, key=lambda c: row[f"{c}_us"])
            row["best"] = best
            results.append(row)
            print(f"{name:8s} M={m:5d} N={n:6d} K={k:5d}  vllm {row['vllm_kernel_us']:8.1f}us  "
                  f"best {best:10s} {row[best + '_us']:8.1f}us  picked {row['picked']:10s} "
                  f"{row[row['picked'] + '_us']:8.1f}us  cublas {row['cublas_us']:8.1f}us  "
                  f"{n * k * 2 / row[best + '_us'] / 1e6:5.2f} TB/s  all equal: "
                  f"{all(row[f'{c}_equal'] is not False for c in configs)}", flush=True)
            print("   " + "  ".join(f"{c} {row[c + '_us']:.1f}" for c in configs), flush=True)
    mismatches = sum(per_config_mismatch.values())
    print(f"bitwise mismatches vs vLLM's kernel: {mismatches} (config, shape) cases; per config: "
          + ", ".join(f"{c} {v}" for c, v in per_config_mismatch.items())
          + (f"; did not run (shared memory): {', '.join(sorted(did_not_fit))}" if did_not_fit else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if mismatches == 0 and not did_not_fit & picks else 1  # a picked config must fit and match


if __name__ == "__main__":
    sys.exit(main())
