"""--generation-gpus 1 on two GPUs: the vLLM engine in a process of its own on the second GPU gives the colocated
run bit for bit (every scalar but times, memory and the Triton builds counted in the trainer's process, the last
checkpoint's files), with --off-policy-steps 1: the weights reach the engine over NCCL exactly, and the trainer's
process, which then builds no engine, still computes as a colocated trainer does (vLLM's process-wide
batch-invariant settings, spirl.engines.vllm_engine.process_wide_settings).
Needs two visible GPUs of one kind (the engine's kernels give the trainer's bits only on the same GPU model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _run(ckpt, root: Path, name: str, *extra: str) -> list[dict]:
    cmd = [sys.executable, str(REPO / "simple_rl.py"), "--model", ckpt, "--task", "synthetic", "--steps", "3",
           "--prompts-per-step", "8", "--group-size", "4", "--max-new-tokens", "64", "--off-policy-steps", "1",
           "--gpu-memory-utilization", "0.3", "--out-dir", str(root / "runs"), "--checkpoint-dir", str(root / "ck"),
           "--run-name", name, *extra]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # keep what the host adds
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("extra", [(), ("--partial-rollout-tokens", "24")], ids=["whole", "partial"])
def test_engine_on_its_own_gpu_is_the_colocated_run(gpu_06b_4layer_ckpt, tmp_path, extra):
    """With its own GPU the engine's rollout is checked after the update, on weights kept from before it
    (TrainConfig.checks_after_update); with partial rollouts the carried groups are read before that check."""
    assert torch.cuda.get_device_name(0) == torch.cuda.get_device_name(1)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/", "triton/"))}  # noqa: E731
                          for r in rows]
    here = _run(gpu_06b_4layer_ckpt, tmp_path, "here", *extra)
    there = _run(gpu_06b_4layer_ckpt, tmp_path, "there", "--generation-gpus", "1", *extra)
    assert strip(there) == strip(here) and all(r["parity/tokens_different"] == 0 for r in there)
    a, b = (tmp_path / "ck" / n / "step_000003" for n in ("here", "there"))
    for f in ("model.safetensors", "optimizer.safetensors", "rollouts.safetensors"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
