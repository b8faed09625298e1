"""LoRA on several ranks (torchrun, replicated adapters, spirl.core.lora) on the CPU: 2 gloo processes with
the native engine against one process, run-to-run determinism, and adapter checkpoints moving between
rank counts.

Five short runs of the tiny model, LoRA rank 4 (2 prompts x 4 samples x 8 tokens, 2 steps, lr 1e-3 so the
adapters move):
    LS   one process                          checkpoints after steps 1 and 2
    LA   2 ranks                              checkpoints after steps 1 and 2
    LA2  2 ranks, LA again                    -> identical to LA, bit for bit (metrics, adapter, AdamW state)
    LC   1 process, --resume LA/step_000001   -> a 2-rank adapter checkpoint resumes on one process
    LD   2 ranks, --resume LS/step_000001     -> a 1-process adapter checkpoint resumes on 2 ranks

What is bitwise and what is not: the ranks sample their share of the prompts with the seeds one process
uses, from the same merged weights, so step 1 draws the same tokens as LS (rewards, parity counts and
lengths bit for bit). The adapters' gradient is averaged over ranks (an all-reduce) instead of summed in
one process, which is the same sum in another order: rounding, bounded below. A resumed run restores the
adapters exactly, so the step after a resume samples what the run it resumes sampled.
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

REPO = Path(__file__).resolve().parents[1]
LR = 1e-3
ARGS = ["--engine", "native", "--model", "random:tiny", "--dtype", "float32", "--task", "synthetic",
        "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8", "--lr", str(LR),
        "--checkpoint-every", "1", "--lora-rank", "4"]
SAME_SAMPLES = ("reward_mean", "reward_std", "parity/tokens_compared", "parity/tokens_different",
                "parity/max_abs_diff", "completion_len_mean", "tokens_trained", "skipped_update")


def _run(root: Path, name: str, ranks: int, *extra: str) -> Path:
    cmd = [sys.executable, str(REPO / "simple_rl.py")]
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(REPO / "simple_rl.py")]
    cmd += [*ARGS, "--steps", "2", "--out-dir", str(root / name / "runs"), "--checkpoint-dir", str(root / "ck"),
            "--run-name", name, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return root / name


@pytest.fixture(scope="module")
def runs(module_dir) -> dict[str, Path]:
    root = module_dir
    r = {"LS": _run(root, "LS", 0), "LA": _run(root, "LA", 2)}
    r["LA2"] = _run(root, "LA2", 2)
    r["LC"] = _run(root, "LC", 0, "--resume", str(root / "ck" / "LA" / "step_000001"))
    r["LD"] = _run(root, "LD", 2, "--resume", str(root / "ck" / "LS" / "step_000001"))
    r["ck"] = root / "ck"
    return r


def _metrics(run: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run / "runs" / run.name / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in lines}


def _files(runs, name: str, step: int) -> dict[str, dict[str, torch.Tensor]]:
    d = runs["ck"] / name / f"step_{step:06d}"
    return {f: load_file(str(d / f"{f}.safetensors")) for f in ("adapter_model", "optimizer")}


def _deterministic(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "memory/"))}


def test_lora_on_two_ranks_samples_what_one_process_samples(runs):
    s, a = _metrics(runs["LS"]), _metrics(runs["LA"])
    assert {k: s[1][k] for k in SAME_SAMPLES} == {k: a[1][k] for k in SAME_SAMPLES}
    for step in (1, 2):
        assert a[step]["parity/tokens_different"] == 0 and a[step]["parity/tokens_compared"] == 64
        assert a[step]["parity/rank0/tokens_compared"] + a[step]["parity/rank1/tokens_compared"] == 64
        assert a[step]["parity/rank0/tokens_different"] == a[step]["parity/rank1/tokens_different"] == 0
        assert a[step]["skipped_update"] == 0, "the comparison needs an update at every step"


def test_lora_gradient_on_two_ranks_is_one_process_gradient_to_rounding(runs):
    """AdamW's exp_avg after one step is exactly 0.1 x the (averaged) gradient: 2 ranks and 1 process agree
    to fp32 rounding of a sum in another order, |d| <= 1e-5 x max|g| per tensor."""
    s, a = _files(runs, "LS", 1)["optimizer"], _files(runs, "LA", 1)["optimizer"]
    assert s.keys() == a.keys()
    moved = 0
    for k in s:
        if k.endswith(".exp_avg"):
            scale = float(s[k].abs().max())
            moved += scale > 0
            assert float((s[k] - a[k]).abs().max()) <= 1e-5 * max(scale, 1e-30), k
    assert moved, "no adapter gradient was non-zero: the comparison proves nothing"


def test_lora_two_rank_runs_repeat_bit_for_bit(runs):
    a, a2 = _metrics(runs["LA"]), _metrics(runs["LA2"])
    assert [_deterministic(a[s]) for s in (1, 2)] == [_deterministic(a2[s]) for s in (1, 2)]
    x, y = _files(runs, "LA", 2), _files(runs, "LA2", 2)
    for what in x:
        assert x[what].keys() == y[what].keys() and all(torch.equal(x[what][k], y[what][k]) for k in x[what]), what


@pytest.mark.parametrize("resumed, origin", [("LC", "LA"), ("LD", "LS")],
                         ids=["2-rank adapter on 1 process", "1-process adapter on 2 ranks"])
def test_lora_checkpoints_resume_on_another_rank_count(runs, resumed, origin):
    r, o = _metrics(runs[resumed]), _metrics(runs[origin])
    assert sorted(r) == [2]
    assert {k: r[2][k] for k in SAME_SAMPLES} == {k: o[2][k] for k in SAME_SAMPLES}
    assert r[2]["parity/tokens_different"] == 0


def test_a_lora_checkpoint_of_two_ranks_is_one_peft_adapter(runs):
    d = runs["ck"] / "LA" / "step_000002"
    assert sorted(p.name for p in d.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                   "optimizer.safetensors", "rng.safetensors", "state.json"]
    assert json.loads((d / "state.json").read_text())["world_size"] == 2


def test_diverged_replicas_are_refused():
    """check_replicas (run at every checkpoint of replicated adapters) names the ranks whose bytes differ."""
    from spirl.core.distributed import World, check_replicas

    class TwoRanks(World):
        def gather(self, obj):
            return [obj, "another digest"]

    t = {"a": torch.ones(3), "step": torch.tensor(1.0)}
    check_replicas(t, World(), "adapters")  # one process: nothing to compare
    with pytest.raises(RuntimeError, match=r"the adapters of rank\(s\) \[1\] differ from rank 0's"):
        check_replicas(t, TwoRanks(rank=0, size=2, sharded=True), "adapters")
