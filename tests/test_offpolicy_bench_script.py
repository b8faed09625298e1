"""compare/offpolicy_bench.py on the CPU (tiny model, native engine, gloo), so that its logic is tested before GPUs
run it: one trainer process and two torchrun ranks, each K run repeated or split off to engine processes of its
own, every equality it checks holding (exit 0). Its timings mean nothing on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_and_two_ranks_with_split_runs(tmp_path):
    cmd = [sys.executable, "-m", "compare.offpolicy_bench", "--out", str(tmp_path), "--model", "random:tiny",
           "--ranks", "1,2", "--split", "2", "--repeat", "1", "--steps", "3", "--prompts-per-step", "2",
           "--group-size", "4", "--max-new-tokens", "4", "--", "--engine", "native", "--device", "cpu", "--dtype",
           "float32", "--task", "synthetic"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "k1-again: identical to k1 in every scalar but times" in lines
    assert "k1-split-x2: identical to k1-x2 in every scalar but times" in lines
    steps = json.loads(lines[-1])["step_s"]
    assert list(steps) == ["sync", "k1", "k1-again", "sync-x2", "k1-x2", "k1-split-x2"]


def test_split_runs_alone_with_and_without_partial_rollouts(tmp_path):
    """--colocated 0 --partial 0,2: only the split runs, once without and once with --partial-rollout-tokens 2;
    the partial run's first step trains nothing (its groups are carried), and each run's parity is checked."""
    cmd = [sys.executable, "-m", "compare.offpolicy_bench", "--out", str(tmp_path), "--model", "random:tiny",
           "--split", "1", "--colocated", "0", "--partial", "0,2", "--repeat", "0", "--steps", "3",
           "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4", "--", "--engine", "native",
           "--device", "cpu", "--dtype", "float32", "--task", "synthetic"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(json.loads(proc.stdout.splitlines()[-1])["step_s"]) == ["k1-split", "k1-split-p2"]
    rows = {n: [json.loads(x) for x in (tmp_path / "runs" / n / "metrics.jsonl").read_text().splitlines()]
            for n in ("k1-split", "k1-split-p2")}
    assert rows["k1-split-p2"][0]["skipped_update"] == 1.0 and "partial/groups_carried" in rows["k1-split-p2"][0]
    assert not any(k.startswith("partial/") for k in rows["k1-split"][0]) and not rows["k1-split"][0]["skipped_update"]
    assert all(r["parity/tokens_different"] == 0 for rs in rows.values() for r in rs)


def test_bad_rank_lists_are_one_line_errors():
    for args, word in ((["--ranks", "1,x"], "comma"), (["--ranks", "1", "--split", "2"], "--split's among"),
                       (["--trl", "two"], "comma"), (["--partial", "0,-1"], "--partial's >= 0"),
                       (["--colocated", "0"], "--colocated 0 leaves only the --split runs")):
        proc = subprocess.run([sys.executable, "-m", "compare.offpolicy_bench", "--out", "/tmp/unused", *args],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and word in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.slow
def test_trl_anchor_beside_the_runs(tmp_path):
    pytest.importorskip("trl")
    cmd = [sys.executable, "-m", "compare.offpolicy_bench", "--out", str(tmp_path), "--model", "random:tiny",
           "--repeat", "0", "--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4",
           "--trl", "1", "--trl-args", "--vllm none --micro-batch 4", "--", "--engine", "native", "--device", "cpu",
           "--dtype", "float32", "--task", "synthetic"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "trl.log").is_file()
    result = json.loads(proc.stdout.splitlines()[-1])
    trl = result["trl_step_s"]["1"]
    assert trl > 0 and set(result["ratio_to_trl"]) == {"sync", "k1"}
    for name in ("sync", "k1"):
        assert result["ratio_to_trl"][name] == result["step_s"][name] / trl
        assert any(line.startswith(f"{name} on 1 GPU(s): ") and "SPIRL / TRL x" in line
                   for line in proc.stdout.splitlines())
