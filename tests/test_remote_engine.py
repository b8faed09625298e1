"""--generation-gpus 1 on the CPU: the native engine in a process of its own (spirl.core.rollout_engine) gives the
colocated run bit for bit, with --off-policy-steps 1 (sampling beside the trainer) and 0; the refusals."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from spirl.core.config import ConfigError, TrainConfig

STEPS = 3


def _cfg(ckpt, root: Path, name: str, **kw) -> TrainConfig:
    base = dict(model=str(ckpt), engine="native", dtype="float32", device="cpu", task="synthetic", steps=STEPS,
                prompts_per_step=2, group_size=4, max_new_tokens=4, lr=1e-3, kl_coef=0.0, updates_per_batch=2,
                checkpoint_every=STEPS, out_dir=str(root / "runs"), checkpoint_dir=str(root / "ck"), run_name=name)
    return TrainConfig(**{**base, **kw}).validate()


def _strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/", "triton/"))} for r in rows]


def _same_tensor_files(a: Path, b: Path) -> bool:
    """Two checkpoint directories hold the same .safetensors files (at least one), byte for byte."""
    names = sorted(p.name for p in a.iterdir() if p.suffix == ".safetensors")
    return bool(names) and names == sorted(p.name for p in b.iterdir() if p.suffix == ".safetensors") and \
        all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


@pytest.mark.parametrize("k", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_engine_in_its_separate_gpus_is_the_colocated_run(tiny_ckpt, tmp_path, caplog, k):
    """The same run with the engine in the trainer's process and in a process of its own: every scalar but times
    and memory equal, and the last checkpoint's files (weights, optimizer state, rollouts sampled ahead) byte for
    byte; the second run's engine was another process (its log line)."""
    from spirl.loops.run import train

    colocated = train(_cfg(tiny_ckpt, tmp_path, "here", off_policy_steps=k))
    with caplog.at_level(logging.INFO, logger="spirl.core.rollout_engine"):
        remote = train(_cfg(tiny_ckpt, tmp_path, "there", off_policy_steps=k, generation_gpus=1))
    assert any("in a process of its own on cpu" in r.getMessage() for r in caplog.records)
    assert len(remote) == STEPS and _strip(remote) == _strip(colocated)
    assert all(r["parity/tokens_different"] == 0 and r["parity/tokens_compared"] > 0 for r in remote)
    assert _same_tensor_files(*(tmp_path / "ck" / n / f"step_{STEPS:06d}" for n in ("here", "there")))


@pytest.mark.parametrize("kw, message", [
    (dict(generation_gpus=1, lora_rank=4), "--generation-gpus with LoRA"),
    (dict(generation_gpus=1, engine="vllm", vllm_sleep=1), "--generation-gpus with --vllm-sleep 1"),
    (dict(generation_gpus=-1), "generation_gpus must be >= 0"),
])
def test_refused_in_one_line(tiny_ckpt, tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        _cfg(tiny_ckpt, tmp_path, "x", **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, message", [
    (dict(task="calculator", generation_gpus=1), "--generation-gpus with the multi-turn task calculator"),
    (dict(generation_gpus=2), r"--generation-gpus 2 with 1 trainer rank\(s\) on this node: .* set --generation-gpus 1"),
])
def test_refused_at_set_up(tiny_ckpt, tmp_path, kw, message):
    from spirl.loops.run import train

    with pytest.raises(ConfigError, match=message) as e:
        train(_cfg(tiny_ckpt, tmp_path, "mt", **kw))
    assert "\n" not in str(e.value)


REWARD = """
def last_token_odd(prompts, completions, completion_ids, **kwargs):
    return [float(c[-1] % 2) if c else 0.0 for c in completion_ids]
"""


def test_next_rollout_begun_before_the_check_keeps_data_order_and_resumes(tiny_ckpt, tmp_path, monkeypatch):
    """With the engine in a process of its own the next rollout is begun before this one is checked, on a kept copy
    of the weights (TrainConfig.checks_after_update): on a dataset read in order, with an eval every 2 steps (which
    uses the engine: nothing is begun before it), the run equals the colocated one in every scalar but times, each
    checkpoint records the same data position, and the run resumed from its step-1 checkpoint gives its steps 2-4
    and its last checkpoint's tensors."""
    import json

    from spirl.core import checkpoint
    from spirl.loops.run import train

    monkeypatch.setattr(checkpoint, "KEEP", 4)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(13)))
    (tmp_path / "rewards.py").write_text(REWARD)
    kw = dict(dataset=str(tmp_path / "data.jsonl"), reward=(f"{tmp_path / 'rewards.py'}:last_token_odd",),
              eval_dataset=str(tmp_path / "data.jsonl"), eval_every=2, eval_size=2, steps=4, checkpoint_every=1,
              off_policy_steps=1, task=TrainConfig.task)  # the base's synthetic task gives way to the dataset
    assert _cfg(tiny_ckpt, tmp_path, "x", generation_gpus=1, **kw).checks_after_update
    here = train(_cfg(tiny_ckpt, tmp_path, "here", **kw))
    there = train(_cfg(tiny_ckpt, tmp_path, "there", generation_gpus=1, **kw))
    again = train(_cfg(tiny_ckpt, tmp_path, "again", generation_gpus=1,
                       resume=str(tmp_path / "ck" / "there" / "step_000001"), **kw))
    assert _strip(there) == _strip(here) and _strip(again) == _strip(there)[1:]
    assert all(r["parity/tokens_different"] == 0 and r["parity/tokens_compared"] > 0 for r in there + again)
    assert sum(r["skipped_update"] == 0 for r in there) >= 2
    assert any("eval/" in k for r in there for k in r)

    def position(name, step):
        return json.loads((tmp_path / "ck" / name / f"step_{step:06d}" / "state.json").read_text())["data_position"]

    assert [position("there", s) for s in range(1, 5)] == [position("here", s) for s in range(1, 5)]
    assert position("again", 4) == position("there", 4)
    assert _same_tensor_files(*(tmp_path / "ck" / n / "step_000004" for n in ("there", "again")))


def test_stop_with_the_next_rollout_begun_checkpoints_and_resumes(tiny_ckpt, tmp_path, monkeypatch, caplog):
    """A SIGTERM after step 2 (the rollout of step 4 begun, TrainConfig.checks_after_update): the run waits for the
    engine, checkpoints step 2 and ends; resumed, it gives the uninterrupted run's steps 3-4 and last checkpoint."""
    from spirl.loops import run as run_module
    from spirl.loops.run import train

    kw = dict(steps=4, off_policy_steps=1, generation_gpus=1, checkpoint_every=0)
    full = train(_cfg(tiny_ckpt, tmp_path, "full", **kw))
    monkeypatch.setattr(run_module, "_stop_requested", lambda run: run.progress.done == 2)
    with caplog.at_level(logging.WARNING, logger="spirl.loops.run"):
        stopped = train(_cfg(tiny_ckpt, tmp_path, "stopped", **kw))
    assert len(stopped) == 2 and any("stopped by SIGTERM after step 2" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    resumed = train(_cfg(tiny_ckpt, tmp_path, "stopped", resume=str(tmp_path / "ck" / "stopped"), **kw))
    assert _strip(resumed) == _strip(full)[2:]
    assert _same_tensor_files(*(tmp_path / "ck" / n / "step_000004" for n in ("full", "stopped")))


def test_engine_process_failure_is_one_line(tmp_path):
    """An engine that cannot be built (no checkpoint there) fails the run in one line naming the engine's process."""
    from spirl.core.rollout_engine import EngineProcess, RemoteEngine, RemoteEngineError
    from spirl.core.spec import EngineSpec

    with pytest.raises(RemoteEngineError, match=r"the engine's process \(on cpu\) failed: building the engine") as e:
        RemoteEngine(EngineProcess(EngineSpec(kind="native", separate_gpus=1), str(tmp_path / "none"), "cpu",
                                   torch.float32))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_two_gloo_ranks_each_with_an_engine_process(tmp_path):
    """Two gloo ranks under torchrun (FSDP2), K = 1, each rank's engine in a process of its own
    (--generation-gpus 2): every scalar but times and memory, and the last checkpoint's files, equal to the two
    ranks with their engines in the trainers' processes."""
    from test_offpolicy import _hashes, _torchrun

    here = _torchrun(tmp_path, "here", 2)
    there = _torchrun(tmp_path, "there", 2, "--generation-gpus", "2")
    assert _strip(there) == _strip(here) and all(r["parity/tokens_different"] == 0 for r in there)
    last = sorted((tmp_path / "ck" / "here").iterdir())[-1].name
    tensors = [{k: v for k, v in _hashes(tmp_path / "ck" / n / last).items() if k.endswith(".safetensors")}
               for n in ("here", "there")]  # state.json holds each run's own config
    assert tensors[0] and tensors[0] == tensors[1]


def test_weight_chunks_keep_order_and_limit():
    """The weight sync's chunks: every tensor once, in order, at most `limit` bytes a chunk (a larger tensor alone)."""
    from spirl.core.rollout_engine import _chunks

    tensors = [(f"w{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 1, 40])]  # float32: 4 bytes each
    chunks = _chunks(tensors, limit=100)
    assert [[name for name, _ in c] for c in chunks] == [["w0", "w1"], ["w2"], ["w3", "w4"], ["w5"]]
    assert all(sum(t.numel() * 4 for _, t in c) <= 100 or len(c) == 1 for c in chunks)
    assert [[name for name, _ in c] for c in _chunks(tensors, limit=1)] == [[n] for n, _ in tensors]


@pytest.mark.parametrize("visible, index, expected", [("4,5,6,7", 2, "6,4,5,7"), ("3,1", 1, "1,3"), (None, 1, "1,0")])
def test_engine_process_sees_its_gpu_first(monkeypatch, visible, index, expected):
    """The engine's process: its GPU is its cuda:0 (where vLLM runs), the trainer's GPUs stay visible after it."""
    from spirl.core import rollout_engine

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert rollout_engine._engine_first(index) == expected


def test_weight_group_shutdown_is_bounded(caplog):
    """A shutdown that does not return (NCCL's finalize waiting for a peer that never finalizes) costs the exit at
    most the bound, with one warning; a shutdown that returns is waited for."""
    import threading
    import time

    from spirl.core.rollout_engine import _shut

    release = threading.Event()

    class Stuck:
        def shutdown(self):
            release.wait(30)

    class Quick:
        called = False

        def shutdown(self):
            Quick.called = True

    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="spirl.core.rollout_engine"):
        _shut(Stuck(), seconds=0.2)
    assert time.perf_counter() - start < 5
    assert "did not shut down within" in caplog.text
    release.set()
    caplog.clear()
    _shut(Quick(), seconds=5)
    assert Quick.called and "did not shut down" not in caplog.text
