"""--off-policy-steps K (spirl/loops/ahead.py) on the CPU: the schedule, its repeatability and resume, and that a
step's behaviour logprobs are those of the weights K updates old, bit for bit.

Runs of the tiny model (native engine, float32; 2 prompts x 4 samples x 4 tokens, 3 steps) shared by a fixture:
    S    synchronous (K = 0)
    A    K = 1, checkpoints after every step
    A2   A again                              -> identical to A: every scalar, every checkpoint file's sha256
    R    K = 1, --resume A/step_000001        -> identical to A's steps 2 and 3 and its step-3 checkpoint
    K2   K = 2
Two gloo ranks (slow): the same K = 1 run twice under torchrun, and its step-2 checkpoint resumed on one process.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from spirl.core.config import ConfigError, TrainConfig
from spirl.core.distributed import World
from spirl.loops import ahead
from spirl.loops.update import Placeholder
from spirl.numerics.samples import Sample
from spirl.numerics.trajectory import Segment, Trajectory

REPO = Path(__file__).resolve().parents[1]
STEPS = 3


def _cfg(ckpt, root: Path, name: str, **kw) -> TrainConfig:
    base = dict(model=str(ckpt), engine="native", dtype="float32", device="cpu", task="synthetic", steps=STEPS,
                prompts_per_step=2, group_size=4, max_new_tokens=4, lr=1e-3, kl_coef=0.0, updates_per_batch=2,
                checkpoint_every=1, out_dir=str(root / "runs"), checkpoint_dir=str(root / "ck"), run_name=name)
    return TrainConfig(**{**base, **kw}).validate()


@pytest.fixture(scope="module")
def runs(tiny_ckpt, module_dir):
    from spirl.core import checkpoint
    from spirl.loops.run import train

    root = module_dir
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "KEEP", STEPS)  # every step's checkpoint kept: the tests read steps 1 and 2
        out = {"S": train(_cfg(tiny_ckpt, root, "S")),
               "A": train(_cfg(tiny_ckpt, root, "A", off_policy_steps=1)),
               "A2": train(_cfg(tiny_ckpt, root, "A2", off_policy_steps=1)),
               "R": train(_cfg(tiny_ckpt, root, "R", off_policy_steps=1,
                               resume=str(root / "ck" / "A" / "step_000001"))),
               "K2": train(_cfg(tiny_ckpt, root, "K2", off_policy_steps=2))}
    return root, out


def _same(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "memory/"))}


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_two_runs_are_identical_bit_for_bit(runs):
    root, out = runs
    assert [_same(m) for m in out["A"]] == [_same(m) for m in out["A2"]]
    for step in range(1, STEPS + 1):
        a, b = _hashes(root / "ck" / "A" / f"step_{step:06d}"), _hashes(root / "ck" / "A2" / f"step_{step:06d}")
        assert a == b and ahead.ROLLOUTS_JSON in a and ahead.ROLLOUTS_TENSORS in a, step


def test_resumed_run_equals_the_uninterrupted_one(runs):
    root, out = runs
    assert [_same(m) for m in out["R"]] == [_same(m) for m in out["A"][1:]]
    last = f"step_{STEPS:06d}"
    assert _hashes(root / "ck" / "R" / last) == _hashes(root / "ck" / "A" / last)


def test_step_one_is_the_synchronous_step_and_later_steps_are_not(runs):
    _, out = runs
    sync, k1 = out["S"], out["A"]
    first = {k: v for k, v in _same(k1[0]).items() if not k.startswith("offpolicy/")}
    assert first == _same(sync[0])
    assert k1[1]["loss"] != sync[1]["loss"]  # step 2 trains on samples of the initial weights, not step 1's


def test_staleness_follows_the_schedule(runs):
    _, out = runs
    assert [m["offpolicy/staleness"] for m in out["A"]] == [0.0, 1.0, 1.0]
    assert [m["offpolicy/staleness"] for m in out["K2"]] == [0.0, 1.0, 2.0]
    assert all("offpolicy/staleness" not in m for m in out["S"])
    # step 1 trains on its own weights' samples: the first mini-batch's ratio is exactly 1
    assert out["A"][0]["offpolicy/ratio_mean"] == 1.0 and out["A"][0]["offpolicy/ratio_std"] == 0.0
    assert out["A"][1]["offpolicy/ratio_std"] > 0
    for m in out["A"] + out["K2"]:
        assert m["parity/tokens_different"] == 0 and m["parity/tokens_compared"] == 2 * 4 * 4


def _rescored(ckpt, masters: Path, seqs: list) -> list[torch.Tensor]:
    """The sequences' logprobs under the weights of a checkpoint's model.safetensors, as the native engine
    scores a generate call's samples (one packed forward over them)."""
    import copy

    from safetensors.torch import load_file
    from weights_vllm_compat import load_model

    from spirl.core.policy import EOS_IDS
    from spirl.engines.native_engine import NativeEngine

    model = load_model(ckpt, dtype=torch.float32)
    model.load_state_dict(load_file(str(masters)), strict=True)
    seqs = NativeEngine(model, EOS_IDS, logprobs="sampling").rescore(copy.deepcopy(seqs), temperature=1.0)
    return [s.logprobs for s in seqs]


def test_behaviour_logprobs_are_those_of_the_weights_k_updates_old(runs, tiny_ckpt):
    """Step 3 of the K = 1 run trains on a rollout its step-2 checkpoint holds: sampled by the weights after
    step 1 (the step-1 checkpoint), whose logprobs they are bit for bit, and not those after step 2."""
    root, _ = runs
    ck = root / "ck" / "A"
    (ready,) = ahead.read_pending(ck / "step_000002", World(), group_size=4)
    assert (ready.step, ready.version) == (3, 1)
    engine_lps = [s.logprobs for s in ready.samples]
    old = _rescored(tiny_ckpt, ck / "step_000001" / "model.safetensors", ready.samples)
    new = _rescored(tiny_ckpt, ck / "step_000002" / "model.safetensors", ready.samples)
    assert all(torch.equal(a, b) for a, b in zip(engine_lps, old))
    assert not all(torch.equal(a, b) for a, b in zip(engine_lps, new))


def test_a_checkpoint_resumes_only_with_its_k(runs, tiny_ckpt, tmp_path):
    from spirl.core.checkpoint import CheckpointError
    from spirl.loops.run import train

    root, _ = runs
    for k, ck in ((0, root / "ck" / "A" / "step_000001"), (1, root / "ck" / "S" / "step_000001")):
        with pytest.raises(CheckpointError, match=r"--off-policy-steps \d; resume with --off-policy-steps"):
            train(_cfg(tiny_ckpt, tmp_path, "X", off_policy_steps=k, resume=str(ck)))


# -- the parts ------------------------------------------------------------------------------------------------


def test_schedule_and_queue():
    assert [ahead.sampled_version(j, 1) for j in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [ahead.sampled_version(j, 0) for j in range(1, 4)] == [0, 1, 2]
    q = ahead.Ahead(2)
    assert q.missing(1) == [1, 2] and ahead.Ahead(0).missing(5) == [5]
    q.put(ahead.Ready(1, 0, [], torch.zeros(0), {}))
    q.put(ahead.Ready(2, 1, [], torch.zeros(0), {}))  # sampled one update too late
    assert q.pop(1).step == 1
    with pytest.raises(RuntimeError, match="would train on samples of policy version 1"):
        q.pop(2)


def test_background_runs_on_its_thread_or_when_asked():
    names = []
    job = ahead.Background(lambda: names.append(threading.current_thread().name) or 7, threaded=True)
    assert job.result() == 7 and names == ["spirl-rollout"]
    lazy = ahead.Background(lambda: names.append(threading.current_thread().name) or 8, threaded=False)
    assert len(names) == 1  # nothing ran yet
    assert lazy.result() == 8 and lazy.result() == 8 and names[1] == threading.current_thread().name

    def fail():
        raise ValueError("engine failed")
    with pytest.raises(ValueError, match="engine failed"):
        ahead.Background(fail, threaded=True).result()


class _Ranks(World):
    """Rank `rank` of `size`, whose gather returns `parts` (what every rank would contribute)."""

    def __init__(self, rank, size, parts=None):
        super().__init__(rank=rank, size=size)
        self.parts = parts

    def gather(self, obj):
        return self.parts if self.parts is not None else [obj]


def test_pending_rollouts_round_trip_bit_for_bit_and_reshard(tmp_path):
    g = torch.Generator().manual_seed(0)

    def sample(i):
        return Sample([1, 2, i], [3, 4 + i], torch.randn(2, generator=g), "length",
                      torch.randint(0, 8, (4, 2, 2), generator=g, dtype=torch.uint8))
    seqs = [sample(i) for i in range(8)]
    adv = torch.randn(8, generator=g)
    # two ranks' shares (2 groups of 2 each) gathered in rank order
    parts = [(seqs[:4], adv[:4]), (seqs[4:], adv[4:])]
    ready = ahead.Ready(5, 3, seqs[:4], adv[:4], {"reward_mean": 0.25, "reward_std": float("nan")})
    doc, tensors = ahead.gather_pending([ready], _Ranks(0, 2, parts))
    ahead.write_pending(tmp_path, doc, tensors)
    (one,) = ahead.read_pending(tmp_path, World(), group_size=2)
    assert (one.step, one.version, one.scalars["reward_mean"]) == (5, 3, 0.25)
    assert torch.equal(one.advantages, adv)
    for a, b in zip(one.samples, seqs):
        assert (a.prompt_ids, a.completion_ids, a.finish_reason) == (b.prompt_ids, b.completion_ids, b.finish_reason)
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.routes, b.routes)
    shares = [ahead.read_pending(tmp_path, _Ranks(r, 3), group_size=2)[0] for r in range(3)]
    assert [len(s.samples) for s in shares] == [2, 2, 4]  # 4 groups over 3 ranks (even_slices): whole groups
    assert torch.equal(torch.cat([s.advantages for s in shares]), adv)
    five = ahead.read_pending(tmp_path, _Ranks(0, 5), group_size=2)[0]  # 4 groups, 5 ranks: rank 0 has none
    assert isinstance(five.samples[0], Placeholder) and torch.equal(five.advantages, torch.zeros(1))


def test_multi_turn_trajectories_round_trip(tmp_path):
    t = Trajectory([Segment([1, 2], False), Segment([3, 4], True, torch.tensor([-0.5, -1.25])),
                    Segment([5], False, None, "tool says 5")], "answered", 1)
    doc, tensors = ahead.gather_pending([ahead.Ready(2, 0, [t, t], torch.tensor([1.0, -1.0]), {})], World())
    ahead.write_pending(tmp_path, doc, tensors)
    (r,) = ahead.read_pending(tmp_path, World(), group_size=2)
    assert r.samples[0].to_json() == t.to_json() and torch.equal(r.samples[0].logprobs, t.logprobs)


@pytest.mark.parametrize("kw, message", [
    (dict(off_policy_steps=-1), "off_policy_steps must be >= 0"),
    (dict(off_policy_steps=1, vllm_sleep=1), "--vllm-sleep 1 cannot be used with --off-policy-steps"),
])
def test_bad_settings_are_refused_in_one_line(kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        TrainConfig(**kw).validate()
    assert "\n" not in str(e.value)


# -- two gloo ranks -------------------------------------------------------------------------------------------


def _torchrun(root: Path, name: str, ranks: int, *extra: str, flags=("--off-policy-steps", "1"),
              steps: int = STEPS) -> list[dict]:
    """simple_rl.py on the tiny model (2 prompts x 4 x 4 tokens, native engine, a checkpoint every step) with
    `flags`, on `ranks` gloo ranks under torchrun (0: one plain process); its metrics."""
    from test_distributed import _env

    cmd = [sys.executable, str(REPO / "simple_rl.py")]
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", cmd[1]]
    args = ["--engine", "native", "--model", "random:tiny", "--dtype", "float32", "--task", "synthetic",
            "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4", "--lr", "1e-3",
            "--checkpoint-every", "1", "--steps", str(steps), *flags,
            "--out-dir", str(root / name), "--checkpoint-dir", str(root / "ck"), "--run-name", name, *extra]
    proc = subprocess.run(cmd + args, capture_output=True, text=True, env=_env(), timeout=900, cwd=root)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return [json.loads(x) for x in (root / name / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_repeat_and_resume_on_one_process(module_dir):
    """K = 1 on two gloo ranks (FSDP2): run twice, every scalar and checkpoint byte equal; its step-2
    checkpoint (rollout 3 pending, split over two ranks) resumed on one process trains step 3 on what the two
    ranks sampled and scored (the gradient is the same sum in another order: test_distributed.py)."""
    root = module_dir / "gloo"
    root.mkdir()
    a, b = _torchrun(root, "A", 2), _torchrun(root, "B", 2)
    assert [_same(m) for m in a] == [_same(m) for m in b]
    assert [m["offpolicy/staleness"] for m in a] == [0.0, 1.0, 1.0]
    last = f"step_{STEPS:06d}"
    assert _hashes(root / "ck" / "A" / last) == _hashes(root / "ck" / "B" / last)
    c = _torchrun(root, "C", 0, "--resume", str(root / "ck" / "A" / "step_000002"))
    keys = ("reward_mean", "reward_std", "parity/tokens_compared", "parity/tokens_different", "tokens_trained")
    assert {k: c[0][k] for k in keys} == {k: a[2][k] for k in keys}  # step 3: the rollout the checkpoint held
