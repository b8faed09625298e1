"""Where the trainer's forward + backward spends its GPU time: torch.profiler, top kernels.

    VLLM_BATCH_INVARIANT=1 python compare/profile_trainer.py --shape Qwen3-1.7B --seqs 8 --len 1024

One random checkpoint, one packed batch of `--seqs` sequences of `--len` tokens, the loss GRPO
backpropagates (sampled-token logprobs at --temperature, plus entropy), the `vllm` backend in
bf16 as the trainer runs it. After --warmup untimed iterations, one profiled iteration; prints the
CUDA kernels by total time (name, calls, total ms, share) and writes a Chrome trace with --trace.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="Qwen3-1.7B")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--activation-checkpointing", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", help="write a Chrome trace here")
    args = p.parse_args(argv)

    import weights
    from spirl.numerics.samples import Sample
    from spirl.numerics.parity import SamplingDist, sampled_logprobs_and_entropy
    from weights_vllm_compat import load_model

    ckpt = Path(tempfile.mkdtemp()) / "ckpt"
    weights.write_random_checkpoint(ckpt, args.shape, num_layers=args.layers, seed=0, dtype=torch.bfloat16)
    model = load_model(ckpt, device="cuda", dtype=torch.bfloat16, backend="vllm")
    model.activation_checkpointing = bool(args.activation_checkpointing)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 151643, (args.len,), generator=g).tolist() for _ in range(args.seqs)]
    samples = [Sample(s[:1], s[1:], torch.empty(0)) for s in seqs]
    dist = SamplingDist(args.temperature)

    def step():
        model.zero_grad(set_to_none=True)
        lps, ent = sampled_logprobs_and_entropy(model, samples, "cuda", dist)
        torch.cat(lps).sum().backward()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"{args.shape} ({model.args.n_layers} layers), {args.seqs} x {args.len} tokens, fwd+bwd: "
          f"{total:.1f} ms of GPU kernels, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print(f"{'kernel':<90} {'calls':>6} {'ms':>9} {'share':>6}")
    for name, calls, ms in rows[:args.top]:
        print(f"{name[:90]:<90} {calls:>6} {ms:>9.2f} {ms / total:>6.1%}")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
