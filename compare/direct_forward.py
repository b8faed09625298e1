"""Generate with vLLM, recompute with Qwen3VLLMCompatModel, and compare every logprob bit for bit.

    VLLM_BATCH_INVARIANT=1 python compare/direct_forward.py --model DIR --prompt "The capital of France is"

Prints a per-token table and a summary (Qwen3-MoE: with the routes compared); exit status 0 only on an exact
bitwise match of every sampled token's logprob (and of every route; at least one token compared), 1 on any
mismatch, 2 on bad arguments.
With --localize, a mismatch is followed by the first layer/op where vLLM's and our activations
differ.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from compare.harness import OPS, HarnessConfig, ParityHarness
from compare.table import format_rows
from torchtitan_compat.tokenizer import NUM_BPE_TOKENS

log = logging.getLogger("direct_forward")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (or HF repo id to download)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded once with the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per sample")
    p.add_argument("--samples", type=int, default=1, help="samples per prompt (vLLM n)")
    p.add_argument("--batch", type=int, default=1,
                   help="prompts per generate call: yours plus batch-1 random prompts of other lengths")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("vllm", "reference"), default="vllm",
                   help="trainer kernel backend (reference = plain PyTorch, expected to differ)")
    p.add_argument("--swap-op", choices=OPS, help="use plain PyTorch for this one op (expected to differ)")
    p.add_argument("--localize", action="store_true", help="on mismatch, find the first differing op")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    args = p.parse_args(argv)
    for name in ("max_tokens", "samples", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature <= 0:
        p.error("--temperature must be > 0 (greedy decoding is not compared here)")
    return args


def prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"error: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}")
    else:
        ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    if not ids:
        raise SystemExit("error: the prompt is empty")
    return ids


def filler_prompts(count: int, seed: int) -> list[list[int]]:
    """Random prompts of varied lengths, batched beside the user's to exercise batch invariance."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 600, (count,), generator=g).tolist()
    return [torch.randint(0, NUM_BPE_TOKENS, (n,), generator=g).tolist() for n in lengths]


def main(argv=None) -> int:
    """Errors: one line on stderr and the exit status of spirl/core/errors.py (run through run_cli)."""
    args = parse_args(argv)
    from spirl.core.errors import log_to_stdout

    log_to_stdout()
    import weights
    from spirl.core.errors import require_batch_invariant, require_cuda, require_vllm
    from spirl.core.preflight import load_checked_tokenizer, validate_model_dir

    require_batch_invariant(" (./run_comparison.sh sets it for you)")
    require_vllm()
    model_dir = str(weights.resolve_model_dir(args.model))
    validate_model_dir(model_dir)  # before anything reads it (the tokenizer, vLLM)
    require_cuda("the parity check (vLLM and the trainer's vllm kernels)")
    tokenizer = load_checked_tokenizer(Path(model_dir))
    ids = prompt_ids(args, tokenizer)
    harness = ParityHarness(HarnessConfig(model_dir, args.backend, args.swap_op, args.seed,
                                          args.gpu_memory_utilization, max_num_seqs=args.batch * args.samples))
    try:
        prompts = [ids] + filler_prompts(args.batch - 1, args.seed)
        samples = harness.generate(prompts, args.samples, args.max_tokens, args.temperature, args.seed)
        report, trainer = harness.compare(samples, args.temperature)
        for i in range(args.samples):  # the user's prompt comes first: its samples are 0..n-1
            print(f"\nsample {i}: prompt {len(ids)} tokens, {len(samples[i].completion_ids)} generated")
            print("\n".join(format_rows(samples[i].completion_ids, samples[i].logprobs, trainer[i],
                                        tokenizer.decode)))
        print(f"\nprompts in the generate call: {len(prompts)}, samples: {len(samples)}, "
              f"trainer backend: {harness.model.backend.name}")
        print(f"Bitwise identical: {report.bitwise_identical}")
        print(f"Tokens compared: {report.tokens_compared}")
        print(f"Tokens different: {report.tokens_different}")
        if report.routes is not None:  # Qwen3-MoE: every token's experts in every sparse layer
            print(f"Routes (token x sparse layer) compared: {report.routes.compared}, router flips: "
                  f"{report.routes.flips}, different in any slot: {report.routes.different}")
        print(report.summary().split(" - ")[-1])
        dense = report.routes is None  # the localizer covers dense Qwen3 only
        if not report.bitwise_identical and args.localize and report.first_mismatch is not None and dense:
            from spirl.numerics.localize import localize_sample

            print(localize_sample(harness, samples[report.first_mismatch[0]].ids))
        return 0 if report.bitwise_identical else 1
    finally:
        harness.close()  # a clean exit (VLLMEngine.close)


if __name__ == "__main__":
    from spirl.core.errors import run_cli

    sys.exit(run_cli(main))
