"""Where a decode step's time goes: torch.profiler over this project's engine, top CUDA kernels.

    VLLM_BATCH_INVARIANT=1 python compare/profile_decode.py --model DIR --batches 8,64 [--cuda-graphs none]

Generates --new-tokens tokens for each batch (prompt --prompt-len random ids, after a warm-up) under
torch.profiler and prints the kernels that take the most GPU time, with their share of the total.
Eager mode (`--cuda-graphs none`) shows the same kernels as the graphs replay, without hiding
any of them inside a graph; with graphs the CPU launch gaps disappear.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from spirl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="8,64")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--cuda-graphs", default=VLLMEngineConfig.cuda_graphs)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--trace-dir", help="also write a Chrome trace per batch here")
    args = p.parse_args(argv)
    llm = VLLMEngine(VLLMEngineConfig(args.model, gpu_memory_utilization=0.8,
                                      cuda_graphs=args.cuda_graphs)).llm
    g = torch.Generator().manual_seed(0)
    for batch in map(int, args.batches.split(",")):
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, 151643, (args.prompt_len,), generator=g).tolist())
                   for _ in range(batch)]
        params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True,
                                temperature=1.0, logprobs=0, seed=0)
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in events) or 1.0
        print(f"\n== batch {batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, cuda graphs "
              f"{args.cuda_graphs}: GPU kernel time {total / 1e3:.1f} ms")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
            print(f"  {100 * e.self_device_time_total / total:5.1f}%  {e.self_device_time_total / 1e3:8.2f} ms  "
                  f"{e.count:6d} calls  {e.key[:90]}")
        if args.trace_dir:
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.trace_dir) / f"decode_b{batch}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
