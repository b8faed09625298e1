"""Acceptance checks for training on several GPUs, each a `torchrun simple_rl.py` run; one table.

    VLLM_BATCH_INVARIANT=1 python compare/multi_gpu.py --out /tmp/mg                 # every check, 2 GPUs
    VLLM_BATCH_INVARIANT=1 python compare/multi_gpu.py --out /tmp/mg --only scaling  # one of them
    python compare/multi_gpu.py --out /tmp/mg --engine native --device cpu --model random:tiny  # CPU, gloo

Checks (each prints what it measured and PASS/FAIL; the exit status is 1 if any failed):
  big      --big-model (Qwen3-8B shape) on --ranks ranks: --steps-big steps of --max-new-tokens, 0
           differing tokens on every rank at every step; per-phase times and peak memory per step
  repeat   --model twice with the same seed on --ranks ranks: identical per-step scalars (all but
           times and memory) and identical sha256 of the final weights
  resume   the repeat run resumed from its step-2 checkpoint: the same step-3 scalars and weights
  scaling  --model with the same per-rank batch on 1 rank and on --ranks ranks: median step time
           (steps 2..) on --ranks ranks over 1 rank, which must be <= --max-scaling (1.15)
The runs write under --out (logs, metrics, checkpoints: the big model's final checkpoint alone holds
12 bytes per parameter, fp32 weights and AdamW state, 98 GB at Qwen3-8B, plus its random fp32 model,
33 GB: point --out at a large disk).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("big", "repeat", "resume", "scaling")


def _run(args, name: str, ranks: int, model: str, extra: list[str]) -> dict[int, dict]:
    """One simple_rl.py run (torchrun with `ranks` processes); its metrics.jsonl by step."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           str(REPO / "simple_rl.py"), "--model", model, "--engine", args.engine, "--task", "synthetic",
           "--group-size", str(args.group_size), "--temperature", "0.7", "--out-dir", str(args.out / "runs"),
           "--checkpoint-dir", str(args.out / "ck"), "--run-name", name, *extra]
    if args.engine == "native":
        cmd += ["--dtype", "float32", "--device", args.device]
    log = args.out / f"{name}.log"
    print(f"[{name}] {' '.join(cmd[3:])}  (log: {log})", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(f"run {name} exited with {rc}; see {log}")
    lines = (args.out / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


def _scalars(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "memory/"))}


def _weights_sha(args, name: str, step: int) -> str:
    path = args.out / "ck" / name / f"step_{step:06d}" / "model.safetensors"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _parity_ok(m: dict, ranks: int) -> bool:
    return m["parity/tokens_different"] == 0 and all(
        m.get(f"parity/rank{r}/tokens_compared", 0) > 0 and m.get(f"parity/rank{r}/tokens_different", 1) == 0
        for r in range(ranks))


def check_big(args) -> bool:
    steps = _run(args, "big", args.ranks, args.big_model,
                 ["--prompts-per-step", str(args.prompts_per_rank * args.ranks), "--max-new-tokens",
                  str(args.max_new_tokens), "--steps", str(args.steps_big), "--checkpoint-every", "0"])
    ok = len(steps) == args.steps_big and all(_parity_ok(m, args.ranks) for m in steps.values())
    for s, m in sorted(steps.items()):
        per_rank = ", ".join(f"rank {r} {int(m[f'parity/rank{r}/tokens_compared'])} compared "
                             f"{int(m[f'parity/rank{r}/tokens_different'])} different" for r in range(args.ranks))
        times = " ".join(f"{k[5:]} {v:.2f}s" for k, v in m.items() if k.startswith("time/"))
        peak = max((v for k, v in m.items() if k.startswith("memory/peak_gib/")), default=float("nan"))
        print(f"  big step {s}: {per_rank}; {times}; peak {peak:.1f} GiB (rank 0)")
    return ok


def check_repeat_and_resume(args, which: set[str]) -> dict[str, bool]:
    common = ["--prompts-per-step", str(args.prompts_per_rank * args.ranks), "--max-new-tokens",
              str(args.max_new_tokens), "--steps", "3", "--checkpoint-every", "2"]
    a = _run(args, "repeat_a", args.ranks, args.model, common)
    out = {}
    if "repeat" in which:
        b = _run(args, "repeat_b", args.ranks, args.model, common)
        same = [_scalars(a[s]) == _scalars(b[s]) for s in (1, 2, 3)]
        sha = (_weights_sha(args, "repeat_a", 3), _weights_sha(args, "repeat_b", 3))
        print(f"  repeat: scalars identical at steps 1-3: {same}; final weights sha256 {sha[0]} vs {sha[1]}")
        out["repeat"] = all(same) and sha[0] == sha[1]
    if "resume" in which:
        r = _run(args, "resume", args.ranks, args.model,
                 common + ["--resume", str(args.out / "ck" / "repeat_a" / "step_000002")])
        same = _scalars(r[3]) == _scalars(a[3])
        sha = (_weights_sha(args, "repeat_a", 3), _weights_sha(args, "resume", 3))
        print(f"  resume: step-3 scalars identical: {same}; final weights sha256 {sha[0]} vs {sha[1]}")
        out["resume"] = same and sha[0] == sha[1]
    return out


def check_scaling(args) -> bool:
    def median_step(steps: dict) -> float:
        return statistics.median(sum(v for k, v in m.items() if k.startswith("time/")) for s, m in steps.items() if s > 1)

    common = ["--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.steps_scaling), "--checkpoint-every", "0"]
    one = _run(args, "scaling_1", 1, args.model, common + ["--prompts-per-step", str(args.prompts_per_rank)])
    many = _run(args, f"scaling_{args.ranks}", args.ranks, args.model,
                common + ["--prompts-per-step", str(args.prompts_per_rank * args.ranks)])
    t1, tn = median_step(one), median_step(many)
    ok = tn / t1 <= args.max_scaling and all(_parity_ok(m, args.ranks) for m in many.values())
    print(f"  scaling: median step {t1:.2f}s on 1 rank ({args.prompts_per_rank} prompts), {tn:.2f}s on {args.ranks} "
          f"ranks ({args.prompts_per_rank * args.ranks} prompts): {tn / t1:.3f}x (bound {args.max_scaling}x)")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="a new or empty directory")
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--model", default="random:Qwen3-1.7B", help="model of repeat, resume and scaling")
    p.add_argument("--big-model", default="random:Qwen3-8B")
    p.add_argument("--engine", default="vllm", choices=("vllm", "native"))
    p.add_argument("--device", default="cuda", help="native engine only: cpu or cuda")
    p.add_argument("--prompts-per-rank", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--steps-big", type=int, default=5)
    p.add_argument("--steps-scaling", type=int, default=5)
    p.add_argument("--max-scaling", type=float, default=1.15)
    args = p.parse_args(argv)
    which = set(args.only.split(","))
    if not which <= set(CHECKS):
        p.error(f"--only: unknown check(s) {sorted(which - set(CHECKS))}; choose from {', '.join(CHECKS)}")
    if args.out.exists() and any(args.out.iterdir()):
        p.error(f"--out {args.out} is not empty; pass a new directory")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, bool] = {}
    try:
        if "big" in which:
            results["big"] = check_big(args)
        if which & {"repeat", "resume"}:
            results.update(check_repeat_and_resume(args, which))
        if "scaling" in which:
            results["scaling"] = check_scaling(args)
    except RuntimeError as e:
        print(f"multi_gpu: {e}", file=sys.stderr)
        return 1
    for name, ok in results.items():
        print(f"{name:8s} {'PASS' if ok else 'FAIL'}")
    return 0 if results and all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
