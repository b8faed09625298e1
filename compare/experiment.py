"""Your own experiment on a GPU: a JSONL dataset with TRL-signature rewards from a file outside the project, and a
reasoning-gym task, under the default loss and the DAPO menu; parity on every step, step time per phase side by side.

    VLLM_BATCH_INVARIANT=1 python compare/experiment.py --out /tmp/exp                      # every run, one GPU
    VLLM_BATCH_INVARIANT=1 python compare/experiment.py --out /tmp/exp --runs ds-grpo,ds-dapo  # some of them
    python compare/experiment.py --out /tmp/exp --runs none                                   # the table only

Two of these may share --out, each on its own GPU (CUDA_VISIBLE_DEVICES), with --model a directory (a
`random:` model would be written by both).

Runs (same model, seed and shape: --prompts-per-step x --group-size x --max-new-tokens, no checkpoints):
  ds-grpo      --dataset train.jsonl --reward rewards.py:correct --reward rewards.py:first_token (weights 1, 0.5);
               the default loss (`grpo`)
  ds-dapo      the same with --loss-type dapo --clip-eps-high 0.28 --mask-truncated-completions 1
  ds-dapo-dyn  ds-dapo with --dynamic-sampling 1
  rg-dapo-dyn  --task reasoning_gym:<--rg-tasks> (its own score_answer) with ds-dapo-dyn's loss flags
train.jsonl is written from reasoning-gym's --rg-tasks (chat-message prompts, an `answer` column); rewards.py
holds `correct` (the answer inside <answer></answer> equals the column) and `first_token` (1 when the first
sampled token id is even: a reward a random model's samples differ on, so that groups have unequal rewards and
dynamic sampling keeps some and drops others; a real model needs no such stand-in).
The table: per-phase medians of steps 2.. (compare/phase_table.py's), `train` = forward + backward + optimizer (the
part the loss menu touches; the rollout of a dynamic-sampling step holds several rounds), each run's ratio to
ds-grpo, parity totals, rewards and dynamic-sampling counts. Exit status 1 if a run failed or any token differed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from compare.phase_table import read_steps, summarize

REPO = Path(__file__).resolve().parents[1]
DAPO = ["--loss-type", "dapo", "--clip-eps-high", "0.28", "--mask-truncated-completions", "1"]
REWARDS = '''"""TRL-signature rewards (f(prompts, completions, completion_ids, **columns) -> list[float | None])."""
import re


def correct(prompts, completions, completion_ids, answer, **kwargs):
    def text(c):
        return c if isinstance(c, str) else c[-1]["content"]
    found = [re.findall(r"<answer>(.*?)</answer>", text(c), re.S) for c in completions]
    return [float(bool(f) and f[-1].strip() == str(a).strip()) for f, a in zip(found, answer)]


def first_token(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids) > 0 and ids[0] % 2 == 0) for ids in completion_ids]
'''


def write_data(out: Path, tasks: str, size: int, seed: int) -> Path:
    import reasoning_gym

    names = tasks.split(",")
    rows = []
    for i, name in enumerate(names):
        for entry in reasoning_gym.create_dataset(name, size=size // len(names), seed=seed + i):
            prompt = [{"role": "user", "content": entry["question"] + "\nGive the final answer inside "
                       "<answer></answer>."}]
            rows.append({"prompt": prompt, "answer": str(entry["answer"]), "task": name})
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, text in (("rewards.py", REWARDS), ("train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))):
        tmp = data / f".{name}.{os.getpid()}"  # two of these scripts may share --out: each writes whole files
        tmp.write_text(text)
        os.replace(tmp, data / name)
    return data


def runs(args, data: Path) -> dict[str, list[str]]:
    ds = ["--dataset", str(data / "train.jsonl"), "--reward", f"{data / 'rewards.py'}:correct",
          "--reward", f"{data / 'rewards.py'}:first_token", "--reward-weights", "1.0,0.5"]
    dyn = ["--dynamic-sampling", "1", "--dynamic-sampling-max-rounds", str(args.max_rounds)]
    return {"ds-grpo": ds, "ds-dapo": ds + DAPO, "ds-dapo-dyn": ds + DAPO + dyn,
            "rg-dapo-dyn": ["--task", f"reasoning_gym:{args.rg_tasks}", "--task-size", "2000"] + DAPO + dyn}


def launch(args, name: str, extra: list[str]) -> int:
    cmd = [sys.executable, str(REPO / "simple_rl.py"), "--model", args.model, "--prompts-per-step",
           str(args.prompts_per_step), "--group-size", str(args.group_size), "--max-new-tokens",
           str(args.max_new_tokens), "--steps", str(args.steps), "--temperature", "1.0", "--lr", "1e-6",
           "--checkpoint-every", "0", "--out-dir", str(args.out / "runs"), "--checkpoint-dir", str(args.out / "ck"),
           "--run-name", name, *extra, *shlex.split(args.extra)]
    log = args.out / f"{name}.log"
    print(f"[{name}] {shlex.join(cmd[1:])}  (log: {log})", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"[{name}] exit {rc}", flush=True)
    return rc


class Run:
    """One run's metrics.jsonl: phase medians of steps 2.. (plus `train`), parity totals, the last step."""

    def __init__(self, path: Path):
        self.steps = read_steps(path)
        self.summary = summarize(self.steps, 1)
        self.median = self.summary["median"]
        self.median["train"] = sum(self.median.get(p, 0.0) for p in ("forward", "backward", "optimizer"))
        self.last = self.steps[max(self.steps)]

    def total(self, key: str) -> int:
        return int(sum(m.get(key, 0) for m in self.steps.values()))

    def cells(self) -> dict[str, str]:
        s, dyn = self.summary, "dynamic/rounds" in self.last
        return {"steps": str(len(self.steps)),
                "parity different/compared": f"{s['different']}/{s['compared']}",
                "peak GiB": f"{s['peak_gib']:.1f}",
                "reward_mean (last step)": f"{self.last.get('reward_mean', float('nan')):.4f}",
                "groups sampled/dropped/kept": "/".join(str(self.total(f"dynamic/groups_{k}"))
                                                        for k in ("sampled", "dropped", "kept")) if dyn else "-",
                "steps at the round limit": str(self.total("dynamic/round_limit")) if dyn else "-"}


def report(out: Path, names: list[str]) -> bool:
    """Print the table of the runs under `out` (in `names`' order); True if every token of every run matched."""
    runs_ = {n: Run(out / "runs" / n / "metrics.jsonl") for n in names
             if (out / "runs" / n / "metrics.jsonl").is_file()}
    if not runs_:
        print("no run has metrics yet")
        return False
    base = runs_.get("ds-grpo", next(iter(runs_.values()))).median
    w = max(len(n) for n in runs_) + 11
    print("median s of steps 2.. (ratio to ds-grpo)".ljust(28) + "".join(n.rjust(w) for n in runs_))
    for p in ("rollout", "parity", "forward", "backward", "optimizer", "train", "step"):
        cells = [f"{r.median.get(p, 0.0):.2f} ({r.median.get(p, 0.0) / base[p]:.2f}x)" if base.get(p)
                 else f"{r.median.get(p, 0.0):.2f}" for r in runs_.values()]
        print(p.ljust(28) + "".join(c.rjust(w) for c in cells))
    cells = [r.cells() for r in runs_.values()]
    for label in cells[0]:
        print(label.ljust(28) + "".join(c[label].rjust(w) for c in cells))
    for name, r in runs_.items():
        print(f"{name}: last step's per-function rewards "
              f"{ {k: round(v, 4) for k, v in r.last.items() if k.startswith('reward/')} }")
    return all(r.summary["different"] == 0 and r.summary["compared"] > 0 for r in runs_.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="a directory (runs already there are kept)")
    p.add_argument("--runs", default="ds-grpo,ds-dapo,ds-dapo-dyn,rg-dapo-dyn",
                   help="comma-separated runs to make (`none`: print the table of what is there)")
    p.add_argument("--model", default="random:Qwen3-1.7B")
    p.add_argument("--rg-tasks", default="basic_arithmetic,leg_counting", help="reasoning-gym datasets")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--max-rounds", type=int, default=4, help="--dynamic-sampling-max-rounds")
    p.add_argument("--extra", default="", help="more simple_rl.py flags for every run, as one string")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "data"
    chosen = [] if args.runs == "none" else args.runs.split(",")
    every = runs(args, data)
    if set(chosen) - set(every):
        p.error(f"--runs: unknown {sorted(set(chosen) - set(every))}; choose from {', '.join(every)}")
    if chosen and not (data / "train.jsonl").is_file():
        write_data(args.out, args.rg_tasks, 2000, 0)
    failed = [name for name in chosen if launch(args, name, every[name]) != 0]
    ok = report(args.out, list(every))
    if failed:
        print(f"failed: {', '.join(failed)} (see their logs under {args.out})")
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
