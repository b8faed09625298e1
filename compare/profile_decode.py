"""Where a rollout's time goes: torch.profiler over this project's engine (or plain vLLM), top CUDA kernels.

    VLLM_BATCH_INVARIANT=1 python compare/profile_decode.py --model DIR --batches 8,64 [--cuda-graphs none]
    VLLM_BATCH_INVARIANT=0 python compare/profile_decode.py --engine plain --model DIR --batches 8,64
    python compare/profile_decode.py --report OURS.jsonl PLAIN.jsonl          # no GPU

For each batch and prompt length (`--prompt-len 16,128`: random ids, after a warm-up) it profiles a prefill (one
new token) and a whole rollout (--new-tokens tokens), and prints the kernels that take the most GPU time in each,
with their share of the total; the rollout's minus the prefill's is the decode. `--json F` appends one line per
(batch, prompt, phase) with the kernel time, so that `--report OURS PLAIN` can put two engines' runs side by side:
per cell the ratio of their rollouts' kernel time, which a slow host does not change (it delays launches, not
kernels), where wall time on a host-bound shape measures the host.
`--engine plain` is vLLM with its defaults (torch.compile, CUDA graphs), as compare/bench_rollout.py
builds it: the same table for what a user would run instead. The process's VLLM_BATCH_INVARIANT must be the engine's
(1 for ours, 0 for plain): refused otherwise.
Eager mode (`--cuda-graphs none`) shows the same kernels as the graphs replay, without hiding
any of them inside a graph; with graphs the CPU launch gaps disappear.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from compare.rollout_sweep import GOAL, parse_ints, print_ratio_table


def read_rows(path: str) -> dict[tuple[int, int, int], dict[str, float]]:
    """A `--json` file -> {(batch, prompt, the rollout's new tokens): {"prefill": kernel ms, "rollout": kernel ms}}
    (a later line for the same cell and phase replaces an earlier one)."""
    cells: dict = {}
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"error: {path}: {e.strerror}: pass a file written by --json")
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            key, phase, ms = (row["batch"], row["prompt"], row["new_tokens"]), row["phase"], float(row["kernel_ms"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise SystemExit(f"error: {path}:{n}: not a row of profile_decode.py --json")
        cells.setdefault(key, {})[phase] = ms
    if not cells:
        raise SystemExit(f"error: {path}: no rows: pass a file written by --json")
    return cells


def compare_rows(ours: dict, plain: dict) -> list[dict]:
    """Cells both engines profiled whole (a rollout; its decode = rollout - prefill where both have a prefill), in
    (batch, prompt) order, with ours / plain of the rollout's kernel time and of the decode's."""
    out = []
    for key in sorted(k for k in ours.keys() & plain.keys() if "rollout" in ours[k] and "rollout" in plain[k]):
        o, p = ours[key], plain[key]
        row = {"batch": key[0], "prompt": key[1], "new_tokens": key[2],
               "rollout_ms": [o["rollout"], p["rollout"]], "ratio": round(o["rollout"] / p["rollout"], 3)}
        if "prefill" in o and "prefill" in p:
            dec = [o["rollout"] - o["prefill"], p["rollout"] - p["prefill"]]
            row["decode_ms"] = [round(d, 3) for d in dec]
            row["decode_ratio"] = round(dec[0] / dec[1], 3) if dec[1] > 0 else None
        out.append(row)
    return out


def report(ours_path: str, plain_path: str, limit: float = GOAL) -> int:
    """Print compare_rows' table; a cell whose rollout kernel ratio is above `limit` (the sweep's goal) is flagged."""
    rows = compare_rows(read_rows(ours_path), read_rows(plain_path))
    if not rows:
        raise SystemExit(f"error: {ours_path} and {plain_path} have no profiled rollout in common")

    def line(r: dict) -> str:
        dec = r.get("decode_ms")
        d = (f"{dec[0]:>11.1f} {dec[1]:>7.1f} " + (f"{r['decode_ratio']:>6.3f}x" if r["decode_ratio"] else "      -")
             if dec else f"{'-':>11} {'-':>7} {'-':>7}")
        return (f"{r['batch']:>6} {r['prompt']:>6} {r['new_tokens']:>5}  {r['rollout_ms'][0]:>8.1f} "
                f"{r['rollout_ms'][1]:>8.1f} {r['ratio']:>6.3f}x  {d}")

    header = (f"{'batch':>6} {'prompt':>6} {'new':>5}  {'ours ms':>8} {'plain ms':>8} {'ratio':>7}  "
              f"{'decode ours':>11} {'plain':>7} {'ratio':>7}")
    print_ratio_table(rows, "ratio", header, line, "rollout kernel time", limit)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--engine", default="ours", choices=["ours", "plain"])
    p.add_argument("--batches", default="8,64", help="batch sizes: integers and ranges, e.g. 1,8,64-66")
    p.add_argument("--prompt-len", default="512", help="prompt lengths, comma separated (one engine serves them)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--cuda-graphs", default=None, help="ours only: the engine's graph mode (default the engine's)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--trace-dir", help="also write a Chrome trace per batch here")
    p.add_argument("--json", help="append one JSON line per (batch, prompt, phase) here: the kernel time")
    p.add_argument("--report", nargs=2, metavar=("OURS", "PLAIN"),
                   help="two --json files (one per engine) side by side: per cell the kernel time ratio; no GPU")
    args = p.parse_args(argv)
    if args.report:
        return report(*args.report)
    if not args.model:
        p.error("--model is required (or --report OURS PLAIN)")
    batches, prompt_lens = parse_ints(args.batches, "--batches"), parse_ints(args.prompt_len, "--prompt-len")

    import torch
    from torch.profiler import ProfilerActivity, profile
    from compare.bench_rollout import build_llm, rollout_inputs
    from spirl.engines.vllm_engine import VLLMEngineConfig

    graphs = args.cuda_graphs or VLLMEngineConfig.cuda_graphs
    engine = args.engine if args.engine == "plain" else f"ours:{graphs}"
    llm = build_llm(engine, args.model, 0.8, max(prompt_lens) + args.new_tokens + 16)
    g = torch.Generator().manual_seed(0)

    for prompt_len in prompt_lens:
        for batch in batches:
            for phase, new in (("prefill", 1), ("rollout", args.new_tokens)):
                # new prompts each time: plain vLLM's prefix cache must not serve the prefill
                llm.generate(*rollout_inputs(batch, prompt_len, new, g, seed=0), use_tqdm=False)  # warm-up, JIT
                prompts, params = rollout_inputs(batch, prompt_len, new, g, seed=0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    llm.generate(prompts, params, use_tqdm=False)
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
                total = sum(e.self_device_time_total for e in events)
                print(f"\n== {args.engine} {phase}: batch {batch}, prompt {prompt_len}, {new} new tokens, "
                      f"cuda graphs {graphs if args.engine == 'ours' else 'vllm default'}: GPU kernel time "
                      f"{total / 1e3:.1f} ms, wall {wall * 1e3:.1f} ms (profiled)", flush=True)
                top = sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]
                for e in top:
                    print(f"  {100 * e.self_device_time_total / (total or 1.0):5.1f}%  "
                          f"{e.self_device_time_total / 1e3:8.2f} ms  {e.count:6d} calls  {e.key[:90]}")
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps({
                            "engine": args.engine, "batch": batch, "prompt": prompt_len,
                            "new_tokens": args.new_tokens, "phase": phase, "generated": new,
                            "kernel_ms": round(total / 1e3, 3), "wall_ms": round(wall * 1e3, 1),
                            "top": [[e.key[:90], round(e.self_device_time_total / 1e3, 3), e.count] for e in top]})
                            + "\n")
                if args.trace_dir:
                    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                    prof.export_chrome_trace(
                        str(Path(args.trace_dir) / f"{args.engine}_{phase}_b{batch}_p{prompt_len}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
