"""compare/trl_grpo.py (TRL's GRPOTrainer on simple_rl.py's checkpoint, task and batch: the anchor for
issue 28's speed comparison) runs end to end on the CPU, full fine-tuning and LoRA, and prints one
step time per optimizer step and its summary. The GPU numbers (vLLM colocated) come from running it
on a GPU box; this test only keeps the script working."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("lora", [0, pytest.param(4, marks=pytest.mark.slow)])
def test_trl_grpo_anchor_runs(tiny_ckpt, tmp_path, lora):
    r = subprocess.run([sys.executable, str(REPO / "compare" / "trl_grpo.py"), "--model", str(tiny_ckpt), "--vllm",
                        "none", "--prompts-per-step", "2", "--group-size", "2", "--micro-batch", "2",
                        "--max-new-tokens", "4", "--steps", "2", "--skip", "1", "--lora-rank", str(lora),
                        "--out", str(tmp_path / "trl")], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)})
    print(r.stdout[-2000:], r.stderr[-2000:])
    assert r.returncode == 0
    assert len(re.findall(r"^trl_grpo: step \d+ [\d.]+ s$", r.stdout, re.M)) == 2
    kind = f"LoRA rank {lora}" if lora else "full fine-tuning"
    assert re.search(rf"^trl_grpo: 2 steps of 2 x 2 samples x 4 new tokens \({kind}, vLLM none\): median [\d.]+ s",
                     r.stdout, re.M)
