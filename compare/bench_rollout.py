"""Rollout speed: this project's vLLM engine vs plain vLLM with CUDA graphs, same checkpoint and prompts.

    VLLM_BATCH_INVARIANT=1 python compare/bench_rollout.py --model DIR            # or --shape Qwen3-1.7B
    python compare/bench_rollout.py --shape Qwen3-1.7B --engines ours,ours:none,plain --json out.json

Each engine runs in its own process (vLLM reads VLLM_BATCH_INVARIANT at import):
  ours        spirl.engines.vllm_engine.VLLMEngine as the trainer builds it (VLLM_BATCH_INVARIANT=1,
              its patches, its default CUDA-graph mode); `ours:MODE` picks another mode
              (none = eager, full, full_decode_only, piecewise)
  plain       vllm.LLM with VLLM_BATCH_INVARIANT=0 and vLLM's defaults (torch.compile + CUDA graphs):
              what a user would run instead
Every engine gets the same --gpu-memory-utilization and generates exactly --new-tokens tokens per
prompt (min_tokens = max_tokens, ignore_eos), T = 1.0, logprobs=0 (an RL trainer needs the sampled
tokens' logprobs either way), one completion per prompt, prompts of --prompt-len random token ids.
Prints generated tokens/s per (batch, new tokens), the engine start time, and each engine's
slowdown relative to `plain` (plain tokens/s / engine tokens/s). With `--repeats N` each case is
timed N times on fresh prompts and the median is used; the spread column shows the run-to-run
noise (at batch 1 the host's speed shows: docs/rollout-profile.md, third run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_llm(engine_name: str, model: str, gpu_memory_utilization: float, max_model_len: int):
    """The vllm.LLM of an engine name: `plain` (vLLM's defaults; the process must have
    VLLM_BATCH_INVARIANT=0), `ours` or `ours:<cuda graph mode>` (the trainer's VLLMEngine)."""
    if engine_name == "plain":
        from vllm import LLM

        return LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                   gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len)
    from spirl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    mode = engine_name.split(":", 1)[1] if ":" in engine_name else VLLMEngineConfig.cuda_graphs
    return VLLMEngine(VLLMEngineConfig(model, seed=0, gpu_memory_utilization=gpu_memory_utilization,
                                       max_model_len=max_model_len, cuda_graphs=mode)).llm


def worker(args) -> None:
    """Build one engine, time every (batch, new tokens) case, print one JSON line per case."""
    import torch

    t0 = time.perf_counter()
    llm = build_llm(args.worker, args.model, args.gpu_memory_utilization, args.max_model_len)
    start = time.perf_counter() - t0
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def prompts_for(batch: int, prompt_len: int, seed: int):
        """Fresh random prompts for every case (the same ones for every engine): a prompt seen
        before would be served from plain vLLM's prefix cache and skip its prefill."""
        g = torch.Generator().manual_seed(seed)
        return [TokensPrompt(prompt_token_ids=torch.randint(0, 151643, (prompt_len,), generator=g).tolist())
                for _ in range(batch)]

    def run(batch: int, prompt_len: int, new: int, seed: int) -> float:
        params = SamplingParams(n=1, max_tokens=new, min_tokens=new, ignore_eos=True, temperature=1.0,
                                logprobs=0, seed=1)
        prompts = prompts_for(batch, prompt_len, seed)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        got = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if got != batch * new:
            raise RuntimeError(f"generated {got} tokens, expected {batch * new}")
        return dt

    cases = parse_cases(args)
    run(8, 64, 16, seed=10**6)  # warm-up: kernels compiled, graphs touched
    for i, (batch, prompt_len, new) in enumerate(cases):
        run(batch, prompt_len, min(new, 8), seed=2 * 10**6 + i)  # this prefill shape's kernels compiled
        times = [run(batch, prompt_len, new, seed=i + 1000 * r) for r in range(args.repeats)]  # fresh prompts each
        dt = statistics.median(times)
        print(json.dumps({"engine": args.worker, "batch": batch, "prompt_len": prompt_len,
                          "new_tokens": new, "seconds": round(dt, 3), "seconds_each": [round(t, 3) for t in times],
                          "tokens_per_s": round(batch * new / dt, 1), "engine_start_s": round(start, 1)}),
              flush=True)


def parse_cases(args) -> list[tuple[int, int, int]]:
    """(batch, prompt tokens, new tokens) per case: --cases "BxPxG,..." or the product of
    --batches and --new-tokens at --prompt-len."""
    if args.cases:
        try:
            cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
        except ValueError:
            cases = []
        if not cases or any(len(c) != 3 or min(c) < 1 for c in cases):
            raise SystemExit(f"error: --cases {args.cases!r}: expected BATCHxPROMPTxNEW[,...] of positive integers, "
                             "e.g. 8x512x256")
        return cases
    return [(b, args.prompt_len, n) for n in map(int, args.new_tokens.split(","))
            for b in map(int, args.batches.split(","))]


def run_engine(name: str, args) -> list[dict]:
    env = {**os.environ, "VLLM_BATCH_INVARIANT": "0" if name == "plain" else "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    cmd = [sys.executable, __file__, "--worker", name, "--model", args.model, "--batches", args.batches,
           "--new-tokens", args.new_tokens, "--prompt-len", str(args.prompt_len), "--cases", args.cases or "",
           "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--max-model-len", str(args.max_model_len),
           "--repeats", str(args.repeats)]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    for r in rows:
        print(f"   {name:24s} batch {r['batch']:4d}  prompt {r['prompt_len']:5d}  new {r['new_tokens']:5d}  {r['tokens_per_s']:10.1f} tok/s", flush=True)
    if proc.returncode != 0:
        print(f"   {name} FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
    return rows


def spread(row: dict) -> str:
    """(slowest - fastest) / median of a case's repeats, as a percentage; "-" for a single timing."""
    each = row.get("seconds_each") or []
    return f"{100 * (max(each) - min(each)) / statistics.median(each):.1f}%" if len(each) > 1 else "-"


def ensure_model(args) -> None:
    if args.model:
        return
    import torch

    import weights

    out = Path(args.cache_dir) / f"bench-{args.shape}"
    if not (out / "config.json").is_file():
        weights.write_random_checkpoint(out, args.shape, seed=0, dtype=torch.bfloat16, overwrite=True)
    args.model = str(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: a random --shape checkpoint)")
    p.add_argument("--shape", default="Qwen3-1.7B", help="weights.py shape for the random checkpoint")
    p.add_argument("--cache-dir", default="checkpoints/models")
    p.add_argument("--engines", default="ours,plain")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--new-tokens", default="256,1024")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--cases", help="BATCHxPROMPTxNEW,... (overrides --batches/--new-tokens/--prompt-len), "
                                   "e.g. 1x512x256,128x2048x64")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=1,
                   help="time each case this many times (fresh prompts each) and report the median; the table's "
                        "spread column is (slowest - fastest) / median, the run-to-run noise a ratio must beat")
    p.add_argument("--json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats {args.repeats}: must be 1 or more")
    if args.worker:
        worker(args)
        return 0
    parse_cases(args)  # a bad --cases fails here, before any engine starts
    ensure_model(args)
    rows = [r for name in args.engines.split(",") for r in run_engine(name, args)]
    plain = {(r["batch"], r["prompt_len"], r["new_tokens"]): r["tokens_per_s"] for r in rows if r["engine"] == "plain"}
    print(f"\n{'engine':24s} {'batch':>5s} {'prompt':>6s} {'new':>5s} {'tok/s':>10s} {'plain tok/s':>12s} {'slowdown':>9s} "
          f"{'start s':>8s} {'spread':>7s}")
    for r in rows:
        ref = plain.get((r["batch"], r["prompt_len"], r["new_tokens"]))
        r["slowdown_vs_plain"] = round(ref / r["tokens_per_s"], 3) if ref else None
        print(f"{r['engine']:24s} {r['batch']:5d} {r['prompt_len']:6d} {r['new_tokens']:5d} {r['tokens_per_s']:10.1f} "
              f"{ref or float('nan'):12.1f} {r['slowdown_vs_plain'] or float('nan'):9.3f}x {r['engine_start_s']:8.1f} "
              f"{spread(r):>7s}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
    failed = {r["engine"] for r in rows} != set(args.engines.split(","))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
