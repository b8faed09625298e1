"""Partial rollouts (--partial-rollout-tokens; spirl/loops/partial.py) on the CPU.

Runs of the tiny model (native engine, float32; 2 prompts x 4 samples, --max-new-tokens 4, checkpoints every step):
    S    no partial rollouts, 3 steps
    P4   --partial-rollout-tokens 4 (= --max-new-tokens): nothing is ever carried  -> S's run bit for bit
    P    --partial-rollout-tokens 2, 4 steps: a group takes two steps (unless EOS ends it)
    P2   P again                                         -> identical scalars and checkpoint bytes
    R    P resumed from its step-2 checkpoint            -> P's steps 3 and 4, P's step-4 checkpoint
    PK   P with --off-policy-steps 1, and PK2 again      -> identical
    PKG  PK with the engine in a process of its own (--generation-gpus 1) -> PK's run bit for bit
"""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch

from spirl.core.config import ConfigError, TrainConfig
from spirl.loops.partial import Carried, PartialState, continuation_seed, ended, extend
from spirl.numerics.samples import Sample

STEPS = 4


def _cfg(ckpt, root, name: str, **kw) -> TrainConfig:
    base = dict(model=str(ckpt), engine="native", dtype="float32", device="cpu", task="synthetic", steps=STEPS,
                prompts_per_step=2, group_size=4, max_new_tokens=4, lr=1e-3, kl_coef=0.0, checkpoint_every=1,
                out_dir=str(root / "runs"), checkpoint_dir=str(root / "ck"), run_name=name)
    return TrainConfig(**{**base, **kw}).validate()


@pytest.fixture(scope="module")
def runs(tiny_ckpt, module_dir):
    from spirl.core import checkpoint
    from spirl.loops import trainer
    from spirl.loops.run import train

    root, trained = module_dir, {}
    real = trainer.train_on

    def recording(run, ro, times, *hooks):  # what each step of P trains on
        trained.setdefault(run.cfg.run_name, []).append(copy.deepcopy(ro.samples))
        return real(run, ro, times, *hooks)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint, "KEEP", STEPS)
        mp.setattr(trainer, "train_on", recording)
        out = {"S": train(_cfg(tiny_ckpt, root, "S", steps=3)),
               "P4": train(_cfg(tiny_ckpt, root, "P4", steps=3, partial_rollout_tokens=4)),
               "P": train(_cfg(tiny_ckpt, root, "P", partial_rollout_tokens=2)),
               "P2": train(_cfg(tiny_ckpt, root, "P2", partial_rollout_tokens=2)),
               "R": train(_cfg(tiny_ckpt, root, "R", partial_rollout_tokens=2,
                               resume=str(root / "ck" / "P" / "step_000002"))),
               "PK": train(_cfg(tiny_ckpt, root, "PK", partial_rollout_tokens=2, off_policy_steps=1)),
               "PK2": train(_cfg(tiny_ckpt, root, "PK2", partial_rollout_tokens=2, off_policy_steps=1)),
               "PKG": train(_cfg(tiny_ckpt, root, "PKG", partial_rollout_tokens=2, off_policy_steps=1,
                                 generation_gpus=1))}
    return root, out, trained


def _same(m: dict) -> dict:
    """The scalars a repeat must reproduce (NaN, a step that scored nothing, compares equal to NaN)."""
    return {k: "nan" if v != v else v for k, v in m.items() if not k.startswith(("time/", "memory/"))}


def _hashes(d, skip=()) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.name not in skip}


def test_a_budget_of_max_new_tokens_is_the_run_without_partial_rollouts(runs):
    root, out, _ = runs
    assert [{k: v for k, v in _same(m).items() if not k.startswith("partial/")} for m in out["P4"]] == \
        [_same(m) for m in out["S"]]
    assert all(m["partial/groups_carried"] == 0 and m["partial/groups_trained"] == 2 for m in out["P4"])
    skip = ("state.json", "partial.json", "partial.safetensors")  # state.json records the config
    assert _hashes(root / "ck" / "P4" / "step_000003", skip) == _hashes(root / "ck" / "S" / "step_000003", skip)


@pytest.mark.parametrize("a, b", [("P", "P2"), ("PK", "PK2")])
def test_partial_runs_repeat_bit_for_bit(runs, a, b):
    root, out, _ = runs
    assert [_same(m) for m in out[a]] == [_same(m) for m in out[b]]
    for step in range(1, STEPS + 1):
        x, y = _hashes(root / "ck" / a / f"step_{step:06d}"), _hashes(root / "ck" / b / f"step_{step:06d}")
        assert x == y and "partial.json" in x, step


def test_engine_in_a_process_of_its_own_continues_as_the_colocated_one(runs):
    """Continuations sent to a remote engine (--generation-gpus 1): PK's scalars but times and memory, and every
    checkpoint's files but state.json (which records the config) byte for byte."""
    root, out, _ = runs
    timing = ("time/", "memory/", "triton/")
    assert [{k: v for k, v in _same(m).items() if not k.startswith(timing)} for m in out["PKG"]] == \
        [{k: v for k, v in _same(m).items() if not k.startswith(timing)} for m in out["PK"]]
    for step in range(1, STEPS + 1):
        d = f"step_{step:06d}"
        x = _hashes(root / "ck" / "PKG" / d, ("state.json",))
        assert x == _hashes(root / "ck" / "PK" / d, ("state.json",)) and "partial.safetensors" in x, step


def test_resumed_run_continues_the_carried_groups(runs):
    root, out, _ = runs
    assert [_same(m) for m in out["R"]] == [_same(m) for m in out["P"][2:]]
    last = f"step_{STEPS:06d}"
    assert _hashes(root / "ck" / "R" / last) == _hashes(root / "ck" / "P" / last)


def test_groups_span_two_steps_with_parity_on_every_segment(runs):
    """Budget 2 of 4 tokens: step 1 trains nothing (its groups are carried), later steps train the groups drawn
    one step earlier; every segment sampled is checked (8 completions x 2 tokens, new and continued)."""
    _, out, _ = runs
    for name in ("P", "PK"):
        m = out[name]
        assert m[0]["skipped_update"] == 1.0 and m[0]["partial/groups_trained"] == 0
        assert all(s["parity/tokens_different"] == 0 and s["parity/tokens_compared"] > 0 for s in m)
        assert all(s["partial/groups_trained"] + s["partial/groups_carried"] >= 2 for s in m)
        assert any(s["partial/segments_max"] == 2 for s in m)


def _rescored(ckpt, masters, samples):
    from safetensors.torch import load_file

    from spirl.core.policy import EOS_IDS
    from spirl.engines.native_engine import NativeEngine
    from weights_vllm_compat import load_model

    model = load_model(ckpt, dtype=torch.float32)
    if masters is not None:
        model.load_state_dict(load_file(str(masters)), strict=True)
    seqs = NativeEngine(model, EOS_IDS, logprobs="sampling").rescore(copy.deepcopy(samples), temperature=1.0)
    return [s.logprobs for s in seqs]


def test_behaviour_logprobs_are_each_segments_policys(runs, tiny_ckpt):
    """P's step 3 trains groups drawn at step 2: their first two tokens were sampled by the weights after step 1
    and the last two by those after step 2, and their logprobs are those weights' bit for bit, segment by segment
    (a completion that EOS ended early has one segment: skipped)."""
    root, out, trained = runs
    ck = root / "ck" / "P"
    samples = [s for s in trained["P"][1] if len(s.completion_ids) == 4]  # step 3's (step 1 trained nothing)
    assert samples and out["P"][2]["partial/groups_trained"] == 2
    v1 = _rescored(tiny_ckpt, ck / "step_000001" / "model.safetensors", samples)
    v2 = _rescored(tiny_ckpt, ck / "step_000002" / "model.safetensors", samples)
    for s, a, b in zip(samples, v1, v2):
        assert torch.equal(s.logprobs[:2], a[:2]) and torch.equal(s.logprobs[2:], b[2:])
    assert not all(torch.equal(s.logprobs[2:], a[2:]) for s, a in zip(samples, v1))


def test_pieces():
    s = Sample([1, 2], [3, 4], torch.tensor([-1.0, -2.0]), "length")
    assert not ended(s, 6) and ended(s, 2) and ended(Sample([1], [3], torch.zeros(1), "stop"), 6)
    e = extend(s, Sample([1, 2, 3, 4], [5], torch.tensor([-3.0]), "stop"))
    assert (e.prompt_ids, e.completion_ids, e.finish_reason) == ([1, 2], [3, 4, 5], "stop")
    assert torch.equal(e.logprobs, torch.tensor([-1.0, -2.0, -3.0]))
    seeds = {continuation_seed(0, (3, i), m, k, 4) for i in range(3) for m in range(4) for k in range(1, 4)}
    assert len(seeds) == 36 and all(0 <= x < 2**31 for x in seeds)
    state = PartialState([Carried((1, i), [s], [{}]) for i in range(5)])

    class Rank:
        size = 2

        def __init__(self, rank):
            self.rank = rank

    shares = [[g.origin for g in state.share(Rank(r))] for r in range(2)]
    assert shares[0] + shares[1] == [(1, i) for i in range(5)] and abs(len(shares[0]) - len(shares[1])) == 1


def test_refusals():
    with pytest.raises(ConfigError, match="partial_rollout_tokens must be >= 0"):
        TrainConfig(partial_rollout_tokens=-1).validate()
    with pytest.raises(ConfigError, match="a filter would judge groups before"):
        TrainConfig(partial_rollout_tokens=8, dynamic_sampling=1).validate()


# -- two gloo ranks -------------------------------------------------------------------------------------------


def _torchrun(root, name: str, ranks: int, *extra: str) -> list[dict]:
    from test_offpolicy import _torchrun as tiny_run

    return tiny_run(root, name, ranks, *extra, flags=("--partial-rollout-tokens", "2"), steps=STEPS)


@pytest.mark.slow
def test_two_ranks_repeat_and_resume_on_one_process(module_dir):
    """Two gloo ranks (FSDP2), each continuing its share of the carried groups: run twice, every scalar and
    checkpoint byte equal; the step-3 checkpoint (two groups carried, sampled on two ranks) resumed on one process
    continues both and trains them at step 4, parity 0."""
    root = module_dir / "gloo"
    root.mkdir()
    a, b = _torchrun(root, "A", 2), _torchrun(root, "B", 2)
    assert [_same(m) for m in a] == [_same(m) for m in b]
    last = f"step_{STEPS:06d}"
    assert _hashes(root / "ck" / "A" / last) == _hashes(root / "ck" / "B" / last)
    assert a[0]["partial/groups_trained"] == 0 and a[1]["partial/groups_carried"] == 2
    c = _torchrun(root, "C", 0, "--resume", str(root / "ck" / "A" / "step_000003"))
    assert c[0]["step"] == 4 and c[0]["partial/groups_trained"] == 2 and c[0]["parity/tokens_different"] == 0


def test_multi_turn_task_is_refused_at_setup(tiny_ckpt, tmp_path):
    from spirl.loops.run import train

    cfg = _cfg(tiny_ckpt, tmp_path, "MT", task="calculator", partial_rollout_tokens=2, steps=1)
    with pytest.raises(ConfigError, match="multi-turn task calculator: an episode's turns are not carried"):
        train(cfg)
