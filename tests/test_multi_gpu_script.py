"""compare/multi_gpu.py, the several-GPU acceptance script, run on the CPU (2 gloo ranks, native engine, tiny
model) so that its logic is tested before a multi-GPU machine runs it: every correctness check with LoRA (the
fault check kills a rank from outside, as on the GPUs), and `big` with full fine-tuning. `scaling` and `trl`
only time runs (their PASS is a speed goal, meaningless on a CPU) and are run by hand on GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU = ["--engine", "native", "--device", "cpu", "--model", "random:tiny", "--group-size", "4", "--max-new-tokens", "8",
       "--prompts-per-rank", "1"]


def _script(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "compare.multi_gpu", "--out", str(out), *CPU, *args], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=1200)


@pytest.mark.slow
def test_every_correctness_check_passes_with_lora_on_two_cpu_ranks(tmp_path):
    proc = _script(tmp_path / "mg", "--lora-rank", "4", "--lr", "1e-3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [x.split()[:2] for x in lines[-5:]] == [[c, "PASS"] for c in ("samples", "repeat", "faults", "resume", "nodes")]
    assert any(x.startswith("  faults: every rank gone ") and "rank 1 (pid" in x for x in lines)


@pytest.mark.slow
def test_big_passes_on_two_cpu_ranks(tmp_path):
    proc = _script(tmp_path / "mg", "--only", "big", "--big-model", "random:tiny", "--steps-big", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1].split()[:2] == ["big", "PASS"]
    assert any(x.startswith("  big step 2: rank 0 ") and "rank 1 " in x for x in lines)


def test_a_non_empty_out_is_refused(tmp_path):
    (tmp_path / "x").write_text("")
    proc = subprocess.run([sys.executable, "-m", "compare.multi_gpu", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "is not empty" in proc.stderr


def test_gpu_indices_are_among_the_gpus_the_script_sees(monkeypatch):
    """Two of these scripts share a 4-GPU host, each given two GPUs: a run on "GPU 0" is on the script's first."""
    from argparse import Namespace

    from compare.multi_gpu import _env

    args = Namespace(engine="vllm")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert _env(args, "0")["CUDA_VISIBLE_DEVICES"] == "2"
    assert _env(args, "1,0")["CUDA_VISIBLE_DEVICES"] == "3,2"
    assert _env(args)["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _env(args, "1")["CUDA_VISIBLE_DEVICES"] == "1"
