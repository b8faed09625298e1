"""Sample filters and over-sampling (--filter, --oversample; spirl/loops/filters.py), on the CPU.

Built-ins on hand-made groups; a filter function from a file outside the package, called with TRL-like arguments
per group; bad specs and configs refused in one line; and runs of the tiny model (native engine, float32; 2
prompts a step, rounds of 4 with --oversample 2, a filter that keeps a group when its first completion starts
with an even token id, 3 steps):
    F    synchronous                          F2  F again          -> identical scalars and checkpoint bytes
    FK   --off-policy-steps 1                 FK2 FK again         -> identical
and one more run with --off-policy-steps 1 whose later rounds take 3 s more each: their time is in the
steps' time/rollout.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from spirl.core.config import ConfigError, TrainConfig
from spirl.loops.filters import FilterError, Group, builtin, function_filter, load_filters
from spirl.numerics.samples import Sample
from spirl.tasks import load_object

STEPS = 3
FILTER = '''
calls = []


def first_even(prompts, completions, completion_ids, rewards, step, **kwargs):
    calls.append({"step": step, "prompts": prompts, "completions": completions, "ids": completion_ids,
                  "rewards": rewards, "kwargs": sorted(kwargs)})
    return completion_ids[0][0] % 2 == 0


def not_a_bool(prompts, completions, completion_ids, rewards, **kwargs):
    return 1


def raises(prompts, completions, completion_ids, rewards, **kwargs):
    raise KeyError("answer")
'''


def group(completions: list[list[int]], rewards: list[float]) -> Group:
    samples = [Sample([1, 2], c, torch.zeros(len(c))) for c in completions]
    r = torch.tensor(rewards, dtype=torch.float32)
    return Group(samples, [{} for _ in samples], r, r[:, None])


def test_builtins_keep_and_drop():
    nan = float("nan")
    spread = builtin("reward_spread").keep
    assert spread(group([[1], [2]], [0.0, 1.0]), 1) and not spread(group([[1], [2]], [1.0, 1.0]), 1)
    assert not spread(group([[1], [2]], [1.0, nan]), 1)  # one scorable reward: no spread
    best = builtin("min_reward:0.5").keep
    assert best(group([[1], [2]], [0.0, 0.5]), 1) and not best(group([[1], [2]], [0.4, nan]), 1)
    diverse = builtin("diversity:0.75").keep
    assert diverse(group([[1, 2], [1, 2], [4], [5]], [0.0] * 4), 1)  # 3 distinct of 4 >= 0.75 x 4
    assert not diverse(group([[1, 2], [1, 2], [4], [4]], [0.0] * 4), 1)  # 2 of 4
    assert not builtin("diversity:0.8").keep(group([[1, 2], [1, 2], [4], [5]], [0.0] * 4), 1)
    assert builtin("length:2-3").keep(group([[1, 2], [1, 2, 3]], [0.0, 0.0]), 1)
    assert not builtin("length:2-3").keep(group([[1], [1, 2, 3]], [0.0, 0.0]), 1)
    assert builtin("length:-2").keep(group([[1], [1, 2]], [0.0, 0.0]), 1)
    assert not builtin("length:3-").keep(group([[1, 2], [1, 2, 3]], [0.0, 0.0]), 1)
    assert builtin("my_file.py:func") is None and builtin("package.module:keep") is None


@pytest.mark.parametrize("spec, message", [
    ("min_reward:abc", "is not a number"), ("diversity:0", "is not a number in"), ("diversity:1.5", "in [1e-09, 1]"),
    ("length:5-2", "LO <= HI"), ("length:7", "length:LO-HI"), ("reward_spread:1", "takes no argument")])
def test_bad_builtin_specs_are_one_line(spec, message):
    with pytest.raises(FilterError) as e:
        builtin(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def _file(tmp_path):
    path = tmp_path / "my_filters.py"
    path.write_text(FILTER)
    return path


def test_function_filter_gets_trl_like_arguments(tmp_path):
    from torchtitan_compat.tokenizer import build_qwen3_tokenizer

    path = _file(tmp_path)
    tok = build_qwen3_tokenizer()
    f = function_filter(f"{path}:first_even", tok)
    g = group([[tok.encode("12")[0], 5], [7]], [1.0, float("nan")])
    assert f.name == "first_even" and f.keep(g, 3) == (g.samples[0].completion_ids[0] % 2 == 0)
    call = load_object(f"{path}:first_even", "--filter", FilterError).__globals__["calls"][-1]
    assert call["step"] == 3 and call["rewards"] == [1.0, None] and call["ids"] == [[tok.encode("12")[0], 5], [7]]
    assert call["completions"] == [tok.decode(c, skip_special_tokens=True) for c in call["ids"]]
    assert call["completions"][0].startswith("1") and call["prompts"] == [tok.decode([1, 2])] * 2
    with pytest.raises(FilterError, match="returned int, not a bool"):
        function_filter(f"{path}:not_a_bool", tok).keep(g, 1)
    with pytest.raises(FilterError, match="raised KeyError"):
        function_filter(f"{path}:raises", tok).keep(g, 1)
    with pytest.raises(FilterError, match="there is no file"):
        function_filter(f"{tmp_path}/missing.py:f", tok)


def test_load_filters_order_duplicates_and_multi_turn(tmp_path):
    path = _file(tmp_path)
    cfg = TrainConfig(dynamic_sampling=1, filter=("reward_spread", "min_reward:1", f"{path}:first_even"))
    assert [f.name for f in load_filters(cfg, None)] == ["reward_spread", "min_reward_1", "first_even"]
    with pytest.raises(FilterError, match="named 'first_even'"):
        load_filters(TrainConfig(filter=(f"{path}:first_even", f"{path.parent}/./my_filters.py:first_even")), None)
    assert [f.name for f in load_filters(TrainConfig(filter=("min_reward:1",)), None, multi_turn=True)] == \
        ["min_reward_1"]
    with pytest.raises(FilterError, match="multi-turn"):
        load_filters(TrainConfig(filter=("length:-5",)), None, multi_turn=True)


def test_oversample_config():
    assert TrainConfig(prompts_per_step=3, oversample=1.5, filter=("reward_spread",)).validate().prompts_per_round == 5
    assert TrainConfig(prompts_per_step=8, oversample=1.5, dynamic_sampling=1).validate().prompts_per_round == 12
    assert TrainConfig(prompts_per_step=8).validate().prompts_per_round == 8
    with pytest.raises(ConfigError, match="--oversample needs --filter"):
        TrainConfig(oversample=2.0).validate()
    with pytest.raises(ConfigError, match="oversample must be >= 1"):
        TrainConfig(oversample=0.5, dynamic_sampling=1).validate()


def test_oversample_must_split_over_ranks():
    from spirl.core.distributed import check_distributed_config

    class Two:
        size = 2

    check_distributed_config(TrainConfig(prompts_per_step=4, group_size=2, oversample=1.5, dynamic_sampling=1), Two())
    with pytest.raises(ConfigError, match="rounds of 3 prompts, which do not split over 2 ranks"):
        check_distributed_config(TrainConfig(prompts_per_step=2, group_size=2, oversample=1.5, dynamic_sampling=1),
                                 Two())


# -- runs ------------------------------------------------------------------------------------------------------


def _cfg(ckpt, root, name: str, spec: str, **kw) -> TrainConfig:
    base = dict(model=str(ckpt), engine="native", dtype="float32", device="cpu", task="synthetic", steps=STEPS,
                prompts_per_step=2, group_size=4, max_new_tokens=4, lr=1e-3, kl_coef=0.0, checkpoint_every=1,
                filter=(spec,), oversample=2.0, dynamic_sampling_max_rounds=3, out_dir=str(root / "runs"),
                checkpoint_dir=str(root / "ck"), run_name=name)
    return TrainConfig(**{**base, **kw}).validate()


@pytest.fixture(scope="module")
def runs(tiny_ckpt, module_dir):
    from spirl.loops.run import train

    root = module_dir
    path = root / "my_filters.py"
    path.write_text(FILTER)
    spec = f"{path}:first_even"
    calls = load_object(spec, "--filter", FilterError).__globals__["calls"]
    out, seen = {}, {}
    for name, kw in (("F", {}), ("F2", {}), ("FK", {"off_policy_steps": 1}), ("FK2", {"off_policy_steps": 1})):
        calls.clear()
        out[name] = train(_cfg(tiny_ckpt, root, name, spec, **kw))
        seen[name] = list(calls)
    return root, out, seen


def _same(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "memory/"))}


def _hashes(d) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("a, b", [("F", "F2"), ("FK", "FK2")])
def test_filtered_runs_repeat_bit_for_bit(runs, a, b):
    root, out, seen = runs
    assert [_same(m) for m in out[a]] == [_same(m) for m in out[b]]
    assert seen[a] == seen[b]
    last = f"step_{STEPS:06d}"
    assert _hashes(root / "ck" / a / last) == _hashes(root / "ck" / b / last)


@pytest.mark.parametrize("name", ["F", "FK"])
def test_counts_follow_the_filters_decisions(runs, name):
    """Rounds of 4 prompts (2 x --oversample 2); per step: sampled = 4 x rounds = one filter call a group; the
    groups it kept = kept + unused; the ones it dropped = filter/first_even/dropped; parity on every token."""
    _, out, seen = runs
    for step, m in enumerate(out[name], 1):
        calls = [c for c in seen[name] if c["step"] == step]
        said_keep = sum(c["ids"][0][0] % 2 == 0 for c in calls)
        assert m["dynamic/groups_sampled"] == 4 * m["dynamic/rounds"] == len(calls)
        assert m["dynamic/groups_kept"] + m["dynamic/groups_unused"] == said_keep
        assert m["filter/first_even/dropped"] == m["dynamic/groups_dropped"] == len(calls) - said_keep
        assert m["dynamic/round_limit"] == float(said_keep < 2) and (said_keep >= 2 or m["dynamic/rounds"] == 3)
        assert m["parity/tokens_different"] == 0 and m["parity/tokens_compared"] > 0
        assert all(len(c["ids"]) == 4 and isinstance(c["completions"][0], str) for c in calls)
        assert all(r is None or math.isfinite(r) for c in calls for r in c["rewards"])
    assert any(m["dynamic/rounds"] > 1 for m in out[name]) and all(m["dynamic/groups_dropped"] for m in out[name])
    if name == "FK":
        assert [m["offpolicy/staleness"] for m in out[name]] == [0, 1, 1]


def test_later_rounds_count_in_the_rollout_time_with_off_policy_steps(tiny_ckpt, tmp_path, monkeypatch):
    """With K > 0 the first round is sampled beside the training and the later rounds of a filtered rollout by
    the trainer, before its update: time/rollout holds both (the later rounds' time was once overwritten)."""
    import time as clock

    from spirl.loops import rollout
    from spirl.loops.run import train

    path = tmp_path / "my_filters.py"
    path.write_text(FILTER)
    real, delay = rollout.generate_round, 3.0  # far above the tiny model's first rounds (~0.3 s a step here)

    def slow_later_rounds(run, step, r, prompts, carried=None):
        if r > 0:
            clock.sleep(delay)
        return real(run, step, r, prompts, carried)

    monkeypatch.setattr(rollout, "generate_round", slow_later_rounds)
    out = train(_cfg(tiny_ckpt, tmp_path, "FT", f"{path}:first_even", off_policy_steps=1, checkpoint_every=0))
    later = sum(m["dynamic/rounds"] - 1 for m in out)  # the trained rollouts' later rounds (at least these)
    assert later >= 1
    assert sum(m["time/rollout"] for m in out) >= delay * later
