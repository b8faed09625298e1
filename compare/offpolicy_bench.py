"""Asynchronous GRPO against the synchronous step: the same run with --off-policy-steps 0 and K, side by side.

    VLLM_BATCH_INVARIANT=1 python compare/offpolicy_bench.py --out /tmp/offp
    VLLM_BATCH_INVARIANT=1 python compare/offpolicy_bench.py --out /tmp/offp --model random:Qwen3-1.7B --k 1 \\
        --steps 6 --prompts-per-step 6 --group-size 8 --max-new-tokens 768 --repeat 1 -- --lr 1e-6

Runs simple_rl.py (one process, this machine's GPU) with --off-policy-steps 0, then K (and K once more with
--repeat 1; and K with --generation-gpus 1, the engine on a second GPU, with --split 1): the same model, seed and
shape, no checkpoints but the last. Prints compare/phase_table.py's
per-phase medians of steps 2.. side by side (with K > 0, `rollout` is the engine's time beside the trainer and
`rollout_wait` what the trainer waited for it), the step-time ratio K over 0 (< 1: faster) and the throughput
gain (its inverse), parity totals, the offpolicy/* means, and whether the repeat equals the first K run in every
scalar but times and memory. Exit status 1 if a run failed, a token differed or the repeat differed.
Arguments after `--` go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compare.phase_table import read_steps, summarize, table

REPO = Path(__file__).resolve().parents[1]


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory of the runs' logs and checkpoints")
    p.add_argument("--model", default="random:Qwen3-1.7B")
    p.add_argument("--k", type=int, default=1, help="--off-policy-steps of the asynchronous runs")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts-per-step", type=int, default=6)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=768)
    p.add_argument("--repeat", type=int, default=1, help="1 = run K twice and compare every scalar")
    p.add_argument("--split", type=int, default=0,
                   help="1 = also run K with --generation-gpus 1 (the engine on the next GPU): its step time against "
                        "the synchronous run's, and every scalar but times against the colocated K run's")
    p.add_argument("--skip", type=int, default=1, help="steps left out of the medians (compiles)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then flags for every simple_rl.py run")
    a = p.parse_args(argv)
    a.rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    return a


def run_one(a, name: str, k: int, *extra: str) -> Path:
    """simple_rl.py into <out>/runs/<name>; its metrics.jsonl."""
    out = Path(a.out)
    cmd = [sys.executable, str(REPO / "simple_rl.py"), "--model", a.model, "--steps", str(a.steps),
           "--prompts-per-step", str(a.prompts_per_step), "--group-size", str(a.group_size),
           "--max-new-tokens", str(a.max_new_tokens), "--off-policy-steps", str(k), "--checkpoint-every", "0",
           "--out-dir", str(out / "runs"), "--checkpoint-dir", str(out / "ck"), "--run-name", name, *a.rest, *extra]
    print(f"$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ, cwd=REPO).returncode
    print(f"{name}: exit {rc} after {time.perf_counter() - start:.0f} s (log {out / f'{name}.log'})", flush=True)
    if rc:
        print((out / f"{name}.log").read_text()[-3000:], flush=True)
        raise SystemExit(1)
    shutil.rmtree(out / "ck" / name, ignore_errors=True)  # the last step's checkpoint: not needed, and large
    return out / "runs" / name / "metrics.jsonl"


def _deterministic(steps: dict[int, dict]) -> list[dict]:
    return [{k: v for k, v in steps[s].items() if not k.startswith(("time/", "memory/", "triton/"))}
            for s in sorted(steps)]


def main(argv=None) -> int:
    a = _args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    names = ["sync", f"k{a.k}"] + ([f"k{a.k}-again"] if a.repeat else []) + ([f"k{a.k}-split"] if a.split else [])
    steps = {n: read_steps(run_one(a, n, 0 if n == "sync" else a.k,
                                   *(["--generation-gpus", "1"] if n.endswith("-split") else [])))
             for n in names}
    sums = [summarize(steps[n], a.skip) for n in names]
    print(table(names, sums))
    sync, k = sums[0]["median"]["step"], sums[1]["median"]["step"]
    print(f"step time K={a.k} / K=0: {k / sync:.3f} (median of steps {sums[1]['steps'][0]}..; throughput "
          f"x{sync / k:.2f})")
    for key in ("offpolicy/staleness", "offpolicy/ratio_mean", "offpolicy/ratio_std", "offpolicy/ratio_clipped_frac"):
        vals = [r[key] for r in steps[names[1]].values() if key in r]
        if vals:
            print(f"{key}: mean {statistics.fmean(vals):.4f} over {len(vals)} steps")
    bad = any(s["different"] for s in sums)
    if a.repeat:
        same = _deterministic(steps[names[1]]) == _deterministic(steps[names[2]])
        print(f"repeat of K={a.k}: {'identical' if same else 'DIFFERENT'} in every scalar but times "
              f"({len(steps[names[1]])} steps)")
        bad = bad or not same
    out = {"ratio": k / sync, "sync_step_s": sync, "k_step_s": k}
    if a.split:
        split = sums[-1]["median"]["step"]
        same = _deterministic(steps[names[1]]) == _deterministic(steps[names[-1]])
        print(f"step time K={a.k} with the engine on its own GPU / K=0: {split / sync:.3f} (throughput "
              f"x{sync / split:.2f}); its scalars {'identical to' if same else 'DIFFERENT from'} the colocated run's")
        out.update(split_ratio=split / sync, split_step_s=split)
        bad = bad or not same
    print(json.dumps(out))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
