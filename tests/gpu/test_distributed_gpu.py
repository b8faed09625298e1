"""simple_rl.py under torchrun on GPUs: FSDP2 training, one vLLM engine per rank (external_launcher).

* One GPU: torchrun with 1 rank (FSDP2 over a mesh of 1, vLLM's external_launcher) is bit for bit
  the plain one-process run: same samples, same scalars, and the same weights and AdamW state
  after every step (FSDP2's all-gather of one shard, its reduce-scatter of one rank and its
  bf16 cast are the identity and the same elementwise cast the one-process trainer does).
* Two GPUs (skipped with fewer): every rank finds 0 differing tokens, and the two ranks sample
  exactly what one process samples from the same weights (the prompts split by whole groups,
  same seeds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--task", "synthetic", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "64",
        "--temperature", "0.7", "--steps", "2", "--checkpoint-every", "1", "--gpu-memory-utilization", "0.25"]
SAME_SAMPLES = ("reward_mean", "reward_std", "parity/tokens_compared", "parity/tokens_different",
                "completion_len_mean", "tokens_trained")


def _run(root: Path, model: str, name: str, ranks: int) -> dict[int, dict]:
    cmd = [sys.executable, str(REPO / "simple_rl.py")]
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(REPO / "simple_rl.py")]
    cmd += [*ARGS, "--model", model, "--out-dir", str(root / "runs"), "--checkpoint-dir", str(root / "ck"),
            "--run-name", name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = (root / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines)}


def _strip(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "memory/", "parity/rank"))}


def test_torchrun_one_rank_is_the_one_process_run_bit_for_bit(gpu_tiny_ckpt, tmp_path):
    plain = _run(tmp_path, gpu_tiny_ckpt, "plain", 0)
    fsdp = _run(tmp_path, gpu_tiny_ckpt, "fsdp", 1)
    for step in (1, 2):
        assert fsdp[step]["parity/tokens_different"] == 0 and fsdp[step]["parity/tokens_compared"] > 0
        assert _strip(fsdp[step]) == _strip(plain[step]), step
        for what in ("model", "optimizer"):
            a = load_file(str(tmp_path / "ck" / "plain" / f"step_{step:06d}" / f"{what}.safetensors"))
            b = load_file(str(tmp_path / "ck" / "fsdp" / f"step_{step:06d}" / f"{what}.safetensors"))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (step, what)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_find_no_mismatch_and_sample_what_one_process_samples(gpu_tiny_ckpt, tmp_path):
    plain = _run(tmp_path, gpu_tiny_ckpt, "plain", 0)
    two = _run(tmp_path, gpu_tiny_ckpt, "two", 2)
    for step in (1, 2):
        for r in (0, 1):
            assert two[step][f"parity/rank{r}/tokens_compared"] > 0
            assert two[step][f"parity/rank{r}/tokens_different"] == 0
    # step 1 starts from the same weights; later steps' weights differ by the gradient's summation order
    assert {k: two[1][k] for k in SAME_SAMPLES} == {k: plain[1][k] for k in SAME_SAMPLES}
