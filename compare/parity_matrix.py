"""The parity matrix on one checkpoint: many batch shapes, lengths, temperatures; zero differences.

    VLLM_BATCH_INVARIANT=1 python compare/parity_matrix.py --model DIR [--quick] [--json OUT]

Cases (one vLLM engine, one trainer model, in one process):
  single   1 prompt  of 2100 tokens, n=2, 256 new tokens, T=1.0
  batch8   8 prompts of 1..2100 tokens, n=2, 128 new tokens, T=0.7
  batch64 64 prompts of 1..2000 tokens, n=2, 64 new tokens, T=1.0 and T=0.7
  odd39   13 prompts of 1..2500 tokens, n=3 (39 sequences: not a CUDA-graph capture size,
          so decode steps run padded graphs), 96 new tokens, T=1.3
  minp    16 prompts of 1..1500 tokens, n=2, 64 new tokens, T=0.9 with min_p=0.05
  long4k   4 prompts of 1..4000 tokens, n=2, 64 new tokens, T=1.0 (the longest prompts --max-model-len
           4096 holds)
  alone    the first 3 prompts of batch8 again, one per call (same seeds): same completions
           and logprobs as inside the batch (vLLM's own batch invariance)
Qwen3-MoE: every case also compares each token's experts in every sparse layer with the engine's
(routes_compared, router_flips = other experts, routes_different = any slot), and the minp case is
left out (vLLM runs Qwen3-MoE on its V1 sampler, whose min-p the trainer does not reproduce). With
--allow-batch-variant (VLLM_BATCH_INVARIANT=0: plain vLLM's MoE kernels) it counts the mismatch that
routing replay exists to hide.
Logprobs are those of the distribution that sampled (vLLM's processed_logprobs: logits / T, then
min-p) unless --logprobs raw. Prints one line per case with the tokens compared and different;
exit 0 only if every case compared > 0 tokens and found 0 different.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from compare.harness import OPS, HarnessConfig, ParityHarness
from spirl.numerics.parity import compare_logprobs
from torchtitan_compat.config import is_moe
from torchtitan_compat.tokenizer import NUM_BPE_TOKENS


def random_prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, NUM_BPE_TOKENS, (n,), generator=g).tolist() for n in lengths]


def spread(count: int, longest: int, seed: int) -> list[int]:
    """`count` lengths from 1 to `longest`, both ends included, the rest random."""
    g = torch.Generator().manual_seed(seed)
    mid = torch.randint(2, longest, (max(count - 2, 0),), generator=g).tolist()
    return ([1, longest] + mid)[:count]


def cases(quick: bool):
    scale = 4 if quick else 1
    return [
        ("single", [2100], 2, 256 // scale, 1.0),
        ("batch8", spread(8, 2100, 1), 2, 128 // scale, 0.7),
        ("batch64_T1.0", spread(64, 2000, 2), 2, 64 // scale, 1.0),
        ("batch64_T0.7", spread(64, 2000, 3), 2, 64 // scale, 0.7),
        ("odd39_T1.3", spread(13, 2500, 4), 3, 96 // scale, 1.3),
        ("minp_T0.9", spread(16, 1500, 5), 2, 64 // scale, 0.9, 0.05),
        ("long4k", spread(4, 4000, 6), 2, 64 // scale, 1.0),
    ]


def run(harness: ParityHarness, quick: bool) -> list[dict]:
    results = []
    moe = is_moe(harness.model.args)
    for i, (name, lengths, n, max_tokens, temp, *min_p) in enumerate(cases(quick)):
        min_p = min_p[0] if min_p else 0.0
        if moe and min_p:  # vLLM's V1 sampler (Qwen3-MoE) applies min-p in a way the trainer does not reproduce
            continue
        t0 = time.perf_counter()
        prompts = random_prompts(lengths, seed=100 + i)
        samples = harness.generate(prompts, n, max_tokens, temp, seed=1000 + i, min_p=min_p)
        report, _ = harness.compare(samples, temp, min_p)
        results.append(dict(case=name, prompts=len(prompts), n=n, temperature=temp, min_p=min_p,
                            logprobs=harness.cfg.logprobs,
                            max_prompt_len=max(lengths), generated=sum(len(s.completion_ids) for s in samples),
                            tokens_compared=report.tokens_compared, tokens_different=report.tokens_different,
                            max_abs_diff=report.max_abs_diff, seconds=round(time.perf_counter() - t0, 1),
                            **route_fields(report)))
        if name == "batch8":
            results.append(alone_vs_batched(harness, prompts, samples, n, max_tokens, temp, 1000 + i))
    return results


def route_fields(report) -> dict:
    """Qwen3-MoE: (token, sparse layer) pairs compared, router flips (other experts), any other difference."""
    r = report.routes
    if r is None:
        return {}
    return dict(routes_compared=r.compared, router_flips=r.flips, routes_different=r.different,
                first_route_difference=r.where() if r.first else None)


def alone_vs_batched(harness, prompts, batched, n, max_tokens, temp, seed) -> dict:
    """vLLM itself: each of the first 3 prompts generated alone must reproduce the batched run."""
    engine_alone, engine_batched, same_tokens = [], [], True
    for j in range(3):
        alone = harness.generate([prompts[j]], n, max_tokens, temp, seed)
        for a, b in zip(alone, batched[j * n:(j + 1) * n]):
            same_tokens &= a.completion_ids == b.completion_ids
            engine_alone.append(a.logprobs)
            engine_batched.append(b.logprobs)
    report = compare_logprobs(engine_batched, engine_alone) if same_tokens else None
    return dict(case="vllm_alone_vs_batch8", same_tokens=same_tokens,
                tokens_compared=report.tokens_compared if report else 0,
                tokens_different=report.tokens_different if report else -1,
                max_abs_diff=report.max_abs_diff if report else float("nan"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--quick", action="store_true", help="a quarter of the generated tokens")
    p.add_argument("--backend", choices=("vllm", "reference"), default="vllm")
    p.add_argument("--swap-op", choices=OPS)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--cuda-graphs", default=HarnessConfig.cuda_graphs,
                   help="the engine's CUDA-graph mode (none = eager)")
    p.add_argument("--logprobs", choices=("sampling", "raw"), default=HarnessConfig.logprobs,
                   help="compare the sampling distribution's logprobs (default) or the raw logits'")
    p.add_argument("--gpu-memory-utilization", type=float, default=HarnessConfig.gpu_memory_utilization,
                   help="the engine's share of the GPU (the trainer's copy of the weights comes on top: 0.47 for "
                        "Qwen3-30B-A3B's 57 GiB)")
    p.add_argument("--max-packed-tokens", type=int, default=HarnessConfig.max_packed_tokens,
                   help="tokens per trainer forward (its float32 logits are 0.6 MB a token at Qwen3's vocabulary)")
    p.add_argument("--allow-batch-variant", action="store_true",
                   help="run without VLLM_BATCH_INVARIANT=1 (to show the check then fails)")
    args = p.parse_args(argv)
    from spirl.core.errors import log_to_stdout

    log_to_stdout()
    import weights
    from spirl.core.errors import require_batch_invariant, require_cuda, require_vllm
    from spirl.core.preflight import validate_model_dir

    if not args.allow_batch_variant:
        require_batch_invariant(" (or pass --allow-batch-variant to show that the check then fails)")
    require_vllm()
    model_dir = str(weights.resolve_model_dir(args.model))
    validate_model_dir(model_dir)
    require_cuda("the parity matrix (vLLM and the trainer's vllm kernels)")
    harness = ParityHarness(HarnessConfig(model_dir, args.backend, args.swap_op,
                                          allow_batch_variant=args.allow_batch_variant,
                                          cuda_graphs=args.cuda_graphs, logprobs=args.logprobs,
                                          gpu_memory_utilization=args.gpu_memory_utilization,
                                          max_packed_tokens=args.max_packed_tokens))
    try:
        results = run(harness, args.quick)
    finally:
        harness.close()  # a clean exit (VLLMEngine.close)
    for r in results:
        print(json.dumps(r))
    total = sum(r["tokens_compared"] for r in results)
    bad = sum(r["tokens_different"] != 0 or r["tokens_compared"] == 0 or r.get("routes_different", 0) != 0
              for r in results)
    routes = sum(r.get("routes_compared", 0) for r in results)
    flips = f", {sum(r['router_flips'] for r in results if 'router_flips' in r)} router flips in {routes} " \
            "(token x sparse layer) routes" if routes else ""
    print(f"parity matrix: {len(results)} cases, {total} tokens compared, {bad} cases with differences{flips}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=args.model, results=results), indent=1))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    from spirl.core.errors import run_cli

    sys.exit(run_cli(main))
