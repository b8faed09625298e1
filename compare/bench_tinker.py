"""The Tinker API's cost per iteration next to simple_rl.py's GRPO step, same model, same batch, same run.

    VLLM_BATCH_INVARIANT=1 python compare/bench_tinker.py --model DIR [--prompts-per-step 32 --group-size 8
        --max-tokens 6 --lora-rank 8 --iterations 12 --skip 2] [--out runs/bench_tinker]

Runs, one after the other on this GPU, (1) `simple_rl.py` (LoRA, task synthetic by default) and (2)
tinker-cookbook's own RL loop through `python -m spirl.tinker compare/tinker_task.py` on the same
model, task, batch (prompts x group, new tokens) and LoRA rank; reads each one's per-iteration wall
clock (simple_rl's `time/step`, the cookbook's `time/total`) and phases from their metrics.jsonl, and
prints medians over the iterations after `--skip` warm-up ones, the ratio API / simple_rl, and the
parity counts of both (0 different is required: the script exits 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _run(cmd: list[str], env: dict, log: Path) -> str:
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    out = log.read_text()
    if proc.returncode != 0:
        sys.exit(f"bench_tinker: {cmd[1]} exited {proc.returncode}; its log: {log}\n{out[-2000:]}")
    return out


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Qwen3 checkpoint directory (weights.py --random ... makes one)")
    p.add_argument("--task", default="synthetic")
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="warm-up iterations left out of the medians")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--out", default="runs/bench_tinker")
    p.add_argument("--engine", default="vllm", choices=["vllm", "native"],
                   help="native: plain PyTorch in float32 (a CPU check of this script, not a measurement)")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SPIRL_TINKER_DIR=str(out / "tinker_runs"), SPIRL_MAX_MODEL_LEN=str(a.max_model_len),
               PYTHONUNBUFFERED="1", SPIRL_ENGINE=a.engine)
    engine = ["--engine", a.engine] + (["--dtype", "float32"] if a.engine == "native" else [])

    grpo = _run([sys.executable, "simple_rl.py", "--model", a.model, "--task", a.task, "--prompts-per-step",
                 str(a.prompts_per_step), "--group-size", str(a.group_size), "--max-new-tokens", str(a.max_tokens),
                 "--steps", str(a.iterations), "--lora-rank", str(a.lora_rank), "--lr", str(a.lr), "--logprobs", "raw",
                 "--max-model-len", str(a.max_model_len), "--checkpoint-every", "0", "--out-dir", str(out / "runs"),
                 "--run-name", "simple_rl", *engine], env, out / "simple_rl.log")
    api = _run([sys.executable, "-m", "spirl.tinker", "compare/tinker_task.py", "--model", a.model, "--task", a.task,
                "--log-path", str(out / "cookbook"), "--iterations", str(a.iterations), "--prompts-per-step",
                str(a.prompts_per_step), "--group-size", str(a.group_size), "--max-tokens", str(a.max_tokens),
                "--lora-rank", str(a.lora_rank), "--lr", str(a.lr), "--eval-every", "0"], env, out / "cookbook.log")

    g_rows = _rows(out / "runs" / "simple_rl" / "metrics.jsonl")[a.skip:]
    c_rows = _rows(out / "cookbook" / "metrics.jsonl")[a.skip:]
    g_step, c_step = _median(g_rows, "time/step"), _median(c_rows, "time/total")
    print(f"\nper iteration, medians of iterations {a.skip + 1}-{a.iterations} "
          f"({a.prompts_per_step} x {a.group_size} samples, {a.max_tokens} new tokens, LoRA rank {a.lora_rank}):")
    print(f"  simple_rl.py step       {g_step:.3f} s   (" + ", ".join(
        f"{k[5:]} {v:.3f}" for k in sorted({k for r in g_rows for k in r if k.startswith("time/") and k != "time/step"})
        if (v := _median(g_rows, k)) is not None) + ")")
    phases = sorted({k for r in c_rows for k in r if k.startswith("time/") and k != "time/total" and ":" not in k})
    print(f"  Tinker API (cookbook)   {c_step:.3f} s   (" + ", ".join(
        f"{k[5:]} {v:.3f}" for k in phases if (v := _median(c_rows, k)) is not None and v >= 0.005) + ")")
    print(f"  ratio API / simple_rl   {c_step / g_step:.2f}x")
    g_diff = sum(r.get("parity/tokens_different", 0) for r in _rows(out / "runs" / "simple_rl" / "metrics.jsonl"))
    g_cmp = sum(r.get("parity/tokens_compared", 0) for r in _rows(out / "runs" / "simple_rl" / "metrics.jsonl"))
    m = re.search(r"parity: (\d+) forward_backward calls, (\d+) sampled tokens compared, (\d+) different", api)
    c_cmp, c_diff = (int(m.group(2)), int(m.group(3))) if m else (0, -1)
    print(f"  parity: simple_rl {int(g_cmp)} compared, {int(g_diff)} different; API {c_cmp} compared, {c_diff} different")
    return 0 if g_diff == 0 and c_diff == 0 and g_cmp > 0 and c_cmp > 0 and grpo else 1


if __name__ == "__main__":
    sys.exit(main())
