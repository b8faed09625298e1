"""compare/multi_gpu.py, the several-GPU acceptance script, run on the CPU (2 gloo ranks, native
engine, tiny model) so that its logic is tested before a multi-GPU machine runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_big_repeat_and_resume_pass_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "mg"
    cmd = [sys.executable, str(REPO / "compare" / "multi_gpu.py"), "--out", str(out), "--only", "big,repeat,resume",
           "--engine", "native", "--device", "cpu", "--model", "random:tiny", "--big-model", "random:tiny",
           "--prompts-per-rank", "1", "--group-size", "4", "--max-new-tokens", "8", "--steps-big", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [x.split()[:2] for x in lines[-3:]] == [["big", "PASS"], ["repeat", "PASS"], ["resume", "PASS"]]
    assert any(x.startswith("  big step 2: rank 0 ") and "rank 1 " in x for x in lines)


def test_a_non_empty_out_is_refused(tmp_path):
    (tmp_path / "x").write_text("")
    proc = subprocess.run([sys.executable, str(REPO / "compare" / "multi_gpu.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "is not empty" in proc.stderr
