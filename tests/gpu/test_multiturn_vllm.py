"""Multi-turn GRPO on real vLLM: every sampled token of every turn bitwise equal to the trainer.

A random tiny checkpoint is first taught the calculator format (spirl.loops.warmstart, so that episodes
have several turns and rewards differ), then simple_rl.py runs --task calculator with vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(args, tmp_path, timeout=900):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=dict(os.environ), capture_output=True,
                          text=True, timeout=timeout)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    return proc


def test_multi_turn_grpo_parity_on_vllm(gpu_tiny_ckpt, tmp_path):
    taught = tmp_path / "calc-tiny"
    run(["-m", "spirl.loops.warmstart", "--model", gpu_tiny_ckpt, "--out", str(taught), "--steps", "100",
         "--batch", "32", "--device", "cuda"], tmp_path)
    run(["simple_rl.py", "--model", str(taught), "--task", "calculator", "--steps", "3",
         "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "48", "--max-turns", "3",
         "--lr", "1e-4", "--out-dir", str(tmp_path / "runs"), "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--run-name", "mt"], tmp_path)
    steps = [json.loads(line) for line in (tmp_path / "runs" / "mt" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    for s in steps:
        m = s
        assert m["parity/tokens_compared"] > 0 and m["parity/tokens_different"] == 0
    assert max(s["episode/turns_mean"] for s in steps) > 1.0
