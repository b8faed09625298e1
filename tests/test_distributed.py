"""Training on several ranks (torchrun, FSDP2) on the CPU: 2 gloo processes with the native engine
against one process, run-to-run determinism, resume, and checkpoints moving between rank counts.

Six short runs of the tiny model (2 prompts x 4 samples x 8 tokens per step, 2 steps) share one
fixture:
    S   one process                          checkpoints after steps 1 and 2
    A   2 ranks                              checkpoints after steps 1 and 2
    A2  2 ranks, A again                     -> identical to A, bit for bit
    B   2 ranks, --resume A/step_000001      -> identical to A, bit for bit
    C   1 process, --resume A/step_000001    -> a 2-rank checkpoint resumes on one process
    D   2 ranks, --resume S/step_000001      -> a 1-process checkpoint resumes on 2 ranks
    N   2 nodes x 1 rank (two torchrun agents, c10d rendezvous), A's config -> identical to A, bit for bit

What is bitwise and what is not, and why. The ranks split the prompts (whole groups) and sample
them with the seeds one process uses, so S and A sample the same tokens and compute the same
logprobs: rewards, parity counts and lengths are equal bit for bit. The gradient is the same sum
in another order (one process: one dW GEMM over all 64 tokens; 2 ranks: two GEMMs of 32 tokens
each, added by the reduce-scatter), so it agrees to fp32 rounding: |dg| <= 1e-5 x max|g| per
tensor (measured 5e-7), read from AdamW's exp_avg, which is exactly 0.1 x g after one step. At
step 1 AdamW moves each weight by lr x g / (|g| + eps), which for a gradient element that cancels
to about 0 turns a rounding difference into any value up to 2 x lr; so the weights are held to
that bound, and at most 1e-5 of them may differ by more than 1e-3 x lr (measured: 20 of 39.6 M).
The same configuration run twice, or resumed, repeats every bit (gloo adds two ranks' values:
one addition, which does not depend on the order).
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
LR = 1e-5
ARGS = ["--engine", "native", "--model", "random:tiny", "--dtype", "float32", "--task", "synthetic",
        "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8", "--lr", str(LR),
        "--checkpoint-every", "1"]
SAME_SAMPLES = ("reward_mean", "reward_std", "parity/tokens_compared", "parity/tokens_different",
                "parity/max_abs_diff", "completion_len_mean", "tokens_trained", "skipped_update")


def _env(omp: bool = True) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if not omp:
        del env["OMP_NUM_THREADS"]
    return env


def _cmd(root: Path, name: str, extra) -> list[str]:
    # one shared random model (written once by S), each run's own logs and checkpoints
    return [*ARGS, "--steps", "2", "--out-dir", str(root / name / "runs"), "--checkpoint-dir", str(root / "ck"),
            "--run-name", name, *extra]


def _run(root: Path, name: str, ranks: int, *extra: str) -> Path:
    """Run simple_rl.py (under torchrun when ranks > 0) into root/name; returns that directory."""
    cmd = [sys.executable, str(REPO / "simple_rl.py")]
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               str(REPO / "simple_rl.py")]
    proc = subprocess.run(cmd + _cmd(root, name, extra), capture_output=True, text=True, env=_env(), timeout=600,
                          cwd=root)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return root / name


def run_two_nodes(root: Path, name: str, *extra: str, env: dict | None = None) -> Path:
    """2 nodes x 1 rank on this machine: two torchrun agents meeting at a c10d rendezvous, as on two
    hosts. OMP_NUM_THREADS is left unset, as a user's shell leaves it (torchrun sets it to 1 only for
    several ranks per node): the ranks must compute what 1 node x 2 ranks computes anyway."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}",
                               str(REPO / "simple_rl.py"), *_cmd(root, name, extra)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root,
                              env=env or _env(omp=False))
             for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), f"{name} failed:\n{outs[0][-3000:]}\n{outs[1][-3000:]}"
    return root / name


@pytest.fixture(scope="module")
def runs(module_dir) -> dict[str, Path]:
    root = module_dir
    r = {"S": _run(root, "S", 0), "A": _run(root, "A", 2)}
    r["A2"] = _run(root, "A2", 2)
    r["B"] = _run(root, "B", 2, "--resume", str(root / "ck" / "A" / "step_000001"))
    r["C"] = _run(root, "C", 0, "--resume", str(root / "ck" / "A" / "step_000001"))
    r["D"] = _run(root, "D", 2, "--resume", str(root / "ck" / "S" / "step_000001"))
    r["N"] = run_two_nodes(root, "N")
    r["ck"] = root / "ck"
    return r


def _metrics(run: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run / "runs" / run.name / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in lines}


def _checkpoint(runs, name: str, step: int, what: str = "model") -> dict[str, torch.Tensor]:
    return load_file(str(runs["ck"] / name / f"step_{step:06d}" / f"{what}.safetensors"))


def _deterministic(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "memory/"))}


@pytest.mark.slow
def test_two_ranks_sample_what_one_process_samples(runs):
    s, a = _metrics(runs["S"]), _metrics(runs["A"])
    for step in (1, 2):
        assert {k: s[step][k] for k in SAME_SAMPLES} == {k: a[step][k] for k in SAME_SAMPLES}, step
        assert a[step]["parity/tokens_different"] == 0 and a[step]["parity/tokens_compared"] == 64
        assert a[step]["parity/rank0/tokens_compared"] + a[step]["parity/rank1/tokens_compared"] == 64
        assert a[step]["skipped_update"] == 0, "the comparison needs an update at every step"
        for k in ("loss", "entropy", "ratio_mean"):  # the ranks' means averaged: rounding only
            assert a[step][k] == pytest.approx(s[step][k], rel=1e-6, abs=1e-9), (step, k)


@pytest.mark.slow
def test_two_ranks_gradient_and_update_match_one_process(runs):
    opt_s, opt_a = _checkpoint(runs, "S", 1, "optimizer"), _checkpoint(runs, "A", 1, "optimizer")
    assert opt_s.keys() == opt_a.keys()
    for k in opt_s:
        if k.endswith(".exp_avg"):  # = 0.1 x the first step's gradient
            scale = float(opt_s[k].abs().max())
            assert scale > 0, k
            assert float((opt_s[k] - opt_a[k]).abs().max()) <= 1e-5 * scale, k
    w_s, w_a = _checkpoint(runs, "S", 1), _checkpoint(runs, "A", 1)
    assert w_s.keys() == w_a.keys()
    total = far = 0
    for k in w_s:
        d = (w_s[k] - w_a[k]).abs()
        assert float(d.max()) <= 2 * LR, k
        total, far = total + d.numel(), far + int((d > 1e-3 * LR).sum())
    assert far <= 1e-5 * total, f"{far} of {total} weights differ by more than 1e-3 x lr"


@pytest.mark.slow
def test_two_rank_runs_repeat_bit_for_bit(runs):
    a, a2 = _metrics(runs["A"]), _metrics(runs["A2"])
    assert [_deterministic(a[s]) for s in (1, 2)] == [_deterministic(a2[s]) for s in (1, 2)]
    for what in ("model", "optimizer"):
        x, y = _checkpoint(runs, "A", 2, what), _checkpoint(runs, "A2", 2, what)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), what


@pytest.mark.slow
def test_two_nodes_of_one_rank_train_what_one_node_of_two_trains(runs):
    """Same configuration, ranks spread over two torchrun agents: the same collectives in the same order,
    so every metric and every byte of the weights and optimizer state is A's. (It differed from the
    8th digit on while a rank alone on its node computed with every CPU thread: see
    spirl.core.distributed._pin_cpu_threads.)"""
    a, n = _metrics(runs["A"]), _metrics(runs["N"])
    assert [_deterministic(a[s]) for s in (1, 2)] == [_deterministic(n[s]) for s in (1, 2)]
    for what in ("model", "optimizer"):
        x, y = _checkpoint(runs, "A", 2, what), _checkpoint(runs, "N", 2, what)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), what


@pytest.mark.slow
def test_two_rank_resume_equals_the_uninterrupted_run(runs):
    a, b = _metrics(runs["A"]), _metrics(runs["B"])
    assert sorted(b) == [2]  # resumed under its own run name: only the step it ran
    assert _deterministic(b[2]) == _deterministic(a[2])
    for what in ("model", "optimizer"):
        x, y = _checkpoint(runs, "A", 2, what), _checkpoint(runs, "B", 2, what)
        assert all(torch.equal(x[k], y[k]) for k in x), what


@pytest.mark.slow
@pytest.mark.parametrize("resumed, origin", [("C", "A"), ("D", "S")],
                         ids=["2-rank checkpoint on 1 process", "1-process checkpoint on 2 ranks"])
def test_checkpoints_resume_on_another_rank_count(runs, resumed, origin):
    # same weights after step 1 -> step 2 samples the same tokens, whatever the rank count
    r, o = _metrics(runs[resumed]), _metrics(runs[origin])
    assert {k: r[2][k] for k in SAME_SAMPLES} == {k: o[2][k] for k in SAME_SAMPLES}
    assert r[2]["parity/tokens_different"] == 0


@pytest.mark.slow
def test_only_rank_zero_writes_logs(runs):
    run_dir = runs["A"] / "runs" / "A"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((run_dir / "run_metadata.json").read_text())["world_size"] == 2
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1


# -- pieces, without processes -------------------------------------------------------------------


def test_prompts_split_into_whole_groups_and_bad_splits_are_refused():
    from spirl.core.config import ConfigError, TrainConfig
    from spirl.core.distributed import World, check_distributed_config, shard_of

    items = list(range(8))
    assert [shard_of(items, World(rank=r, size=4, sharded=True)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ConfigError, match="--prompts-per-step 3 does not split over 2 ranks"):
        check_distributed_config(TrainConfig(prompts_per_step=3), World(size=2, sharded=True))
    with pytest.raises(ConfigError, match="--updates-per-batch 3"):
        check_distributed_config(TrainConfig(prompts_per_step=4, group_size=2, updates_per_batch=3),
                                 World(size=2, sharded=True))


def test_weights_sync_in_parts_like_the_whole(qwen06_2layer_ckpt, tiny_ckpt):
    """compat_part_to_hf over one layer at a time gives what compat_to_vllm_weights gives at once
    (tied and untied embeddings)."""
    from weights_vllm_compat import compat_part_to_hf, compat_to_vllm_weights, load_model

    for ckpt in (qwen06_2layer_ckpt, tiny_ckpt):
        model = load_model(ckpt, backend="reference")
        sd = {k: v.detach() for k, v in model.named_parameters()}
        whole = dict(compat_to_vllm_weights(sd, model.args))
        parts: dict[str, torch.Tensor] = {}
        for layer in ["tok_embeddings", *(f"layers.{i}." for i in range(model.args.n_layers)), "norm", "output"]:
            parts.update(compat_part_to_hf({k: v for k, v in sd.items() if k.startswith(layer)}, model.args))
        assert parts.keys() == whole.keys()
        assert all(torch.equal(parts[k], whole[k]) for k in whole)


def test_sharded_memory_plan_divides_the_optimizer_state():
    from spirl.core.config import TrainConfig
    from spirl.core.memory_plan import estimate, param_count
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

    args = model_args_from_hf_config(hf_config_for_shape("Qwen3-8B"))
    import batch_invariant_backward as bib

    cfg, kw = TrainConfig(), dict(logits_chunk_elements=bib.LOGITS_CHUNK_ELEMENTS)  # as spirl.core.preflight passes
    h200 = 139 * 2**30
    one, two = estimate(args, cfg, h200, **kw), estimate(args, cfg, h200, shards=2, **kw)
    p = param_count(args)
    assert one.parts["AdamW state"] == 8 * p and two.parts["AdamW state"] == 4 * p
    assert two.parts["fp32 masters"] == 2 * p and two.parts["fp32 grads"] == 2 * p
    assert two.parts["compute model"] < one.parts["compute model"] / 4  # root + 2 of 36 layers
    assert not one.fits and two.fits  # Qwen3-8B: not on one H200, yes on two


def _rank0_of_two(peer):
    """Rank 0 of a 2-rank World whose peer (rank 1) contributes `peer` to every gather."""
    from spirl.core.distributed import World

    class TwoRanks(World):
        def gather(self, obj):
            return [obj, self.peer]

    w = TwoRanks(rank=0, size=2, sharded=True)
    w.peer = peer
    return w


def test_a_mismatch_on_another_rank_fails_this_rank_naming_it(tmp_path):
    from types import SimpleNamespace

    from spirl.numerics.samples import Sample
    from spirl.numerics.parity import ParityError, check_parity

    s = Sample([1, 2], [3, 4], torch.tensor([-1.0, -2.0]))
    policy = SimpleNamespace(world=_rank0_of_two("tokens compared: 2, different: 1 (report: r1.json)"))
    with pytest.raises(ParityError, match=r"^step 7: rank 1: tokens compared: 2, different: 1 \(report: r1.json\)$"):
        check_parity([s], [torch.tensor([-1.0, -2.0])], 7, tmp_path, engine=None, policy=policy)
    assert not list(tmp_path.iterdir())  # this rank matched: it writes no report
    policy.world.peer = None  # no rank differs: the report is returned
    assert check_parity([s], [torch.tensor([-1.0, -2.0])], 7, tmp_path, None, policy).tokens_different == 0


def test_an_error_on_one_rank_is_raised_on_every_rank():
    from spirl.core.errors import EXIT_IO, UserError

    rank0 = _rank0_of_two((UserError, ("could not write checkpoint", EXIT_IO)))
    with pytest.raises(UserError, match="could not write checkpoint") as e:
        rank0.raise_if_any(None)
    assert e.value.exit_code == EXIT_IO
    rank0.peer = None
    rank0.raise_if_any(None)  # nobody failed: nothing raised


@pytest.mark.parametrize("saved, device, restored, note", [
    ({"torch_cuda": 10}, 1, 10, None),                        # this format: the writer's own GPU, onto ours
    ({f"torch_cuda_{i}": 20 + i for i in range(4)}, 0, 20, "3 of the checkpoint's 4"),  # older: 4 GPUs, resumed on 1
    ({f"torch_cuda_{i}": 20 + i for i in range(2)}, 3, None, "2 of the checkpoint's 2"),  # older: no state of GPU 3
    ({"torch_cuda": 10}, None, None, "1 of the checkpoint's 1"),  # a GPU checkpoint resumed on the CPU
], ids=["own", "4-GPU checkpoint on 1", "other GPUs only", "on the CPU"])
def test_rng_states_of_gpus_that_are_not_here_are_skipped_with_one_line(monkeypatch, saved, device, restored, note):
    """A checkpoint written on N GPUs resumes on M (the IndexError of set_rng_state_all with 4 states and 2
    GPUs): the state of this process's GPU is restored, the others are named in one line."""
    import random

    from spirl.core import checkpoint as ckpt

    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device is not None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: set_to.append(s))
    state = {"python_rng": [3, list(random.getstate()[1]), None],
             "_rng": {"torch_cpu": torch.get_rng_state(), **saved}}
    said = ckpt.restore_rng(state)
    assert set_to == ([] if restored is None else [restored])
    if note is None:
        assert said is None
    else:
        assert said.startswith(note) and "no sample depends on them" in said
