"""Where a rollout's time goes: torch.profiler over this project's engine (or plain vLLM), top CUDA kernels.

    VLLM_BATCH_INVARIANT=1 python compare/profile_decode.py --model DIR --batches 8,64 [--cuda-graphs none]
    VLLM_BATCH_INVARIANT=0 python compare/profile_decode.py --engine plain --model DIR --batches 8,64

For each batch (prompt --prompt-len random ids, after a warm-up) it profiles a prefill (one new
token) and a whole rollout (--new-tokens tokens), and prints the kernels that take the most GPU
time in each, with their share of the total; the rollout's minus the prefill's is the decode.
`--engine plain` is vLLM with its defaults (torch.compile, CUDA graphs), as compare/bench_rollout.py
builds it: the same table for what a user would run instead. The process's VLLM_BATCH_INVARIANT must be the engine's
(1 for ours, 0 for plain): refused otherwise.
Eager mode (`--cuda-graphs none`) shows the same kernels as the graphs replay, without hiding
any of them inside a graph; with graphs the CPU launch gaps disappear.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from compare.bench_rollout import build_llm, rollout_inputs
    from spirl.engines.vllm_engine import VLLMEngineConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--engine", default="ours", choices=["ours", "plain"])
    p.add_argument("--batches", default="8,64")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--cuda-graphs", default=VLLMEngineConfig.cuda_graphs)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--trace-dir", help="also write a Chrome trace per batch here")
    args = p.parse_args(argv)
    engine = args.engine if args.engine == "plain" else f"ours:{args.cuda_graphs}"
    llm = build_llm(engine, args.model, 0.8, args.prompt_len + args.new_tokens + 16)
    g = torch.Generator().manual_seed(0)

    for batch in map(int, args.batches.split(",")):
        for phase, new in (("prefill", 1), ("rollout", args.new_tokens)):
            # new prompts each time: plain vLLM's prefix cache must not serve the prefill
            llm.generate(*rollout_inputs(batch, args.prompt_len, new, g, seed=0), use_tqdm=False)  # warm-up, JIT
            prompts, params = rollout_inputs(batch, args.prompt_len, new, g, seed=0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            total = sum(e.self_device_time_total for e in events) or 1.0
            print(f"\n== {args.engine} {phase}: batch {batch}, prompt {args.prompt_len}, {new} new tokens, "
                  f"cuda graphs {args.cuda_graphs if args.engine == 'ours' else 'vllm default'}: GPU kernel time "
                  f"{total / 1e3:.1f} ms, wall {wall * 1e3:.1f} ms (profiled)")
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
                print(f"  {100 * e.self_device_time_total / total:5.1f}%  {e.self_device_time_total / 1e3:8.2f} ms  "
                      f"{e.count:6d} calls  {e.key[:90]}")
            if args.trace_dir:
                Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(Path(args.trace_dir) / f"{args.engine}_{phase}_b{batch}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
