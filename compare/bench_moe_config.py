"""Fused-MoE Triton tiles that keep vLLM's batch-invariant bits, timed against the one vLLM pins and its tuned ones.

    python -m compare.bench_moe_config --tokens 1,8,64,256,1024,4096,16384 [--json F]     # one GPU, ~2 min

vLLM 0.26.0 in batch-invariant mode runs the experts' GEMMs (`fused_moe_kernel`) with one config for every token
count: BLOCK 64 x 64 x 32, GROUP_M 8, Triton's default warps and stages. Outside that mode it reads a tuned config
per token count (on an H200, `E=128,N=768,device_name=NVIDIA_H200.json`: BLOCK_M 16 at decode, BLOCK_K 64-256).
A row's bits depend on the K order (BLOCK_K 32 chunks, one fp32 accumulator, one rounding), not on which tile or
how many rows the tile holds; so tiles of other BLOCK_M / BLOCK_N / GROUP_M / warps / stages with BLOCK_K 32 are
candidates, each *checked* here: the sparse block's output and gate/up output `torch.equal` to the pinned
config's at every token count, or the candidate is marked "differs" and never chosen.

Per token count T (random bf16 activations, Qwen3-30B-A3B's layer by default, routes from a random router through
vLLM's own top-k): median CUDA-event time of the whole experts' op as the engine runs it (token sort, both GEMMs,
SiLU-and-mul, the top-k sum) for the pinned config, for vLLM's tuned config (its own BLOCK_K: what plain vLLM
runs, bits not expected equal), and for every candidate; prints the fastest equal candidate and its ratios.
Runs with VLLM_BATCH_INVARIANT=1 (the trainer's vLLM backend needs it); vLLM's tuned configs are the table the
trainer and the engine pick from (`torchtitan_compat.vllm_ops.tuned_moe_configs`: the file vLLM reads outside that
mode).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,8,64,256,1024,4096,16384", help="comma-separated token counts")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=20, help="timed runs per (config, T), after 3 warm-up runs")
    p.add_argument("--json", default=None, help="append one JSON line per token count to this file")
    a = p.parse_args(argv)
    try:
        a.token_counts = [int(t) for t in a.tokens.split(",") if t.strip()]
    except ValueError:
        p.error("--tokens takes integers, comma-separated")
    if not a.token_counts or min(a.token_counts) < 1:
        p.error("--tokens: give token counts >= 1")
    return a


def key(cfg: dict) -> tuple:
    return tuple(cfg.get(k) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
                                      "num_stages"))


def name(cfg: dict) -> str:
    m, n, k, g, w, s = key(cfg)
    return f"{m}x{n}x{k} g{g} w{w if w else '-'} s{s if s else '-'}"


def candidates(tuned: list[dict], pinned: dict) -> list[dict]:
    """BLOCK_K-32 tiles (about 30: each costs Triton compiles): vLLM's tuned tiles with BLOCK_K set to 32, at their
    own stage count and at 4, and a grid of BLOCK_M 16-128 x BLOCK_N 64-128 (4 warps, 3 and 4 stages). The pinned
    config first."""
    out = {key(pinned): dict(pinned)}
    tiles = {(c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c.get("GROUP_SIZE_M", 8), c.get("num_warps", 4),
              c.get("num_stages", 3)) for c in tuned}
    tiles |= {(m, n, 8, 4, 3) for m in (16, 32, 64, 128) for n in (64, 128)}
    for m, n, g, w, own in sorted(tiles):
        for s in sorted({own, 4}):
            cfg = {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": g, "SPLIT_K": 1,
                   "num_warps": w, "num_stages": s}
            out.setdefault(key(cfg), cfg)
    return list(out.values())


def timed(fn, iters: int) -> float:
    """Median milliseconds of fn() over `iters` runs (CUDA events), after 3 warm-up runs."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(a, be, weights, tuned_map, cands, t: int) -> dict:
    """One token count: the pinned config's time, vLLM's tuned config's, and every candidate's (equal or not)."""
    import torch

    from torchtitan_compat.vllm_ops import BATCH_INVARIANT_MOE_CONFIG

    wg, w13, w2 = weights
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, a.hidden, generator=g, device="cuda").to(torch.bfloat16)
    w, ids = be.moe_route(be.linear(x, wg), a.top_k, True)
    run = lambda cfg: be.moe_experts(x, w13, w2, w, ids, config=cfg)  # noqa: E731
    y0, c0 = run(BATCH_INVARIANT_MOE_CONFIG)
    row = {"tokens": t, "pinned_ms": timed(lambda: run(BATCH_INVARIANT_MOE_CONFIG), a.iters), "candidates": []}
    if tuned_map:
        tuned = tuned_map[min(tuned_map, key=lambda m: abs(m - t))]
        row["tuned"], row["tuned_ms"] = name(tuned), timed(lambda: run(tuned), a.iters)
        row["tuned_equal"] = bool(torch.equal(run(tuned)[0], y0))
    for cfg in cands:
        try:
            y, c1 = run(cfg)
        except Exception as e:  # a tile the GPU cannot hold (Triton's OutOfResources): not a candidate here
            row["candidates"].append({"config": name(cfg), "error": f"{type(e).__name__}: {str(e)[:80]}"})
            continue
        equal = bool(torch.equal(y, y0) and torch.equal(c1, c0))
        row["candidates"].append({"config": name(cfg), "equal": equal, "ms": timed(lambda: run(cfg), a.iters),
                                  "cfg": cfg})
    return row


def report(row: dict) -> str:
    ok = [c for c in row["candidates"] if c.get("equal")]
    differ = sum(1 for c in row["candidates"] if c.get("equal") is False)
    best = min(ok, key=lambda c: c["ms"])
    tuned = (f"vLLM tuned {row['tuned']} {row['tuned_ms']:.3f} ms ({'equal' if row['tuned_equal'] else 'other bits'}); "
             if "tuned" in row else "")
    vs_tuned = f", {best['ms'] / row['tuned_ms']:.2f}x tuned" if "tuned" in row else ""
    return (f"T {row['tokens']:>6}: pinned {row['pinned_ms']:.3f} ms; {tuned}best equal {best['config']} "
            f"{best['ms']:.3f} ms = {row['pinned_ms'] / best['ms']:.2f}x faster than pinned{vs_tuned}; "
            f"{len(ok)} candidates equal, {differ} differ")


def main(argv=None) -> int:
    a = parse_args(argv)
    if os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        print("bench_moe_config: error: run with VLLM_BATCH_INVARIANT=1 (the vllm kernel backend needs it)",
              file=sys.stderr)
        return 2
    import torch

    from torchtitan_compat.vllm_ops import BATCH_INVARIANT_MOE_CONFIG, VLLMBackend, tuned_moe_configs

    if not torch.cuda.is_available():
        print("bench_moe_config: error: needs a CUDA GPU", file=sys.stderr)
        return 2
    tuned_map = tuned_moe_configs(a.experts, a.inter)
    print(f"vLLM's tuned configs for E={a.experts}, N={a.inter} on {torch.cuda.get_device_name()}: "
          f"{len(tuned_map)} token counts" + ("" if tuned_map else " (none: its default configs)"), flush=True)
    cands = candidates(list(tuned_map.values()), BATCH_INVARIANT_MOE_CONFIG)
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g, device="cuda") * 0.02).to(torch.bfloat16)  # noqa: E731
    weights = (rnd(a.experts, a.hidden), rnd(a.experts, 2 * a.inter, a.hidden), rnd(a.experts, a.hidden, a.inter))
    be = VLLMBackend(sampler="v1")
    for t in a.token_counts:
        row = measure(a, be, weights, tuned_map, cands, t)
        print(report(row), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
