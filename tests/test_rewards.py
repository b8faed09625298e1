"""Reward functions with TRL's signature (spirl/tasks/rewards.py): loaded from a file anywhere or a module, called
with TRL's arguments, combined with TRL's semantics (None = not applicable, weights, nansum); compared with TRL
1.16's own GRPOTrainer._calculate_rewards on the same functions and inputs; every way a reward function or its
spec can be wrong is one line naming the function and the sample. The math reward and gsm8k on math-verify."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from spirl.tasks.rewards import RewardError, RewardSet, load_reward, parse_weights

FUNCS = '''
def length(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]

def only_even_ids(prompts, completions, completion_ids, id, **kwargs):
    return [1.0 if i % 2 == 0 else None for i in id]

def sees(prompts, completions, completion_ids, answer, trainer_state, log_metric, **kwargs):
    log_metric("calls", 1.0)
    return [float(trainer_state.global_step) + (c == a) for c, a in zip(completions, answer)]

def nothing(prompts, completions, completion_ids, **kwargs):
    return [None] * len(prompts)

def raises(prompts, completions, completion_ids, **kwargs):
    raise KeyError("solution")

def short(prompts, completions, completion_ids, **kwargs):
    return [1.0]

def text(prompts, completions, completion_ids, **kwargs):
    return ["1.0"] * len(prompts)

def infinite(prompts, completions, completion_ids, **kwargs):
    return [float("inf")] * len(prompts)

def scalar(prompts, completions, completion_ids, **kwargs):
    return 1.0
'''


@pytest.fixture
def funcs(tmp_path):
    path = tmp_path / "my_rewards.py"  # a file outside the project, as a user writes it
    path.write_text(FUNCS)
    return path


def _call(rs: RewardSet, n=4, step=3):
    from spirl.tasks.rewards import trainer_state

    return rs(["p"] * n, ["a", "b", "a", "c"][:n], [[1], [2, 3], [4], []][:n],
              {"id": [0, 1, 2, 3][:n], "answer": ["a"] * n}, trainer_state(step, SimpleNamespace(steps=10,
                                                                                                updates_per_batch=1)))


def test_trl_semantics_none_weights_and_kwargs(funcs):
    rs = RewardSet.load([f"{funcs}:length", f"{funcs}:only_even_ids", f"{funcs}:sees"], "0.5,2,1")
    assert rs.names == ["length", "only_even_ids", "sees"]
    s = _call(rs)
    nan = float("nan")
    expected = torch.tensor([[1, 1, 2 + 1], [2, nan, 2 + 0], [1, 1, 2 + 1], [0, nan, 2 + 0]])
    assert torch.equal(torch.isnan(s.per_func), torch.isnan(expected))
    assert torch.equal(s.per_func.nan_to_num(0), expected.nan_to_num(0))
    # weighted sum over the functions that applied: 0.5 len + 2 [even] + sees
    assert s.rewards.tolist() == [0.5 + 2 + 3, 1 + 2, 0.5 + 2 + 3, 0 + 2]
    assert s.metrics == {"calls": [1.0]}  # log_metric


def test_a_sample_no_function_applies_to_is_unscorable(funcs):
    s = _call(RewardSet.load([f"{funcs}:nothing", f"{funcs}:only_even_ids"]))
    assert s.rewards[0] == 1.0 and math.isnan(s.rewards[1]) and math.isnan(s.rewards[3])


def test_rewards_match_trls_own_calculate_rewards(funcs):
    """TRL 1.16's GRPOTrainer._calculate_rewards, called on the same functions and rows (a stand-in trainer
    object with the attributes it reads), gives our per-function values; the weighted sum is TRL's line
    `(rewards_per_func * reward_weights).nansum(dim=1)` with unscorable rows NaN."""
    from transformers import TrainerState
    from trl import GRPOTrainer

    rs = RewardSet.load([f"{funcs}:length", f"{funcs}:only_even_ids", f"{funcs}:sees"], "0.5,2,1")
    ours = _call(rs)
    logged = []
    trainer = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
                              args=SimpleNamespace(report_to=[]), state=TrainerState(global_step=2),
                              reward_funcs=[f.fn for f in rs.functions], reward_processing_classes=[None] * 3,
                              reward_func_names=rs.names, _log_completion_extra=lambda *a: None,
                              _log_metric=lambda name, value: logged.append((name, value)), environments=None)
    rows = [{"prompt": "p", "id": i, "answer": "a"} for i in range(4)]
    theirs = GRPOTrainer._calculate_rewards(trainer, rows, ["p"] * 4, ["a", "b", "a", "c"], [[1], [2, 3], [4], []])
    assert torch.equal(torch.isnan(theirs), torch.isnan(ours.per_func))
    assert torch.equal(theirs.nan_to_num(0), ours.per_func.nan_to_num(0))  # global_step 2 = our step 3's
    trl_rewards = (theirs * torch.tensor(rs.weights).unsqueeze(0)).nansum(dim=1)
    trl_rewards[torch.isnan(theirs).all(dim=1)] = float("nan")
    assert torch.equal(trl_rewards, ours.rewards) and logged == [("calls", 1.0)]


@pytest.mark.parametrize("name, needle", [
    ("raises", "reward function raises (FILE:raises) raised KeyError: 'solution' on the batch; fix the function"),
    ("short", "reward function short (FILE:short) returned 1 values for 4 samples; return one per sample"),
    ("text", "reward function text (FILE:text) returned '1.0' (a str, not a number) for sample 0; return a number "
             "or None"),
    ("infinite", "reward function infinite (FILE:infinite) returned inf for sample 0; return a finite number"),
    ("scalar", "reward function scalar (FILE:scalar) returned float, not a list of 4 numbers"),
])
def test_a_bad_reward_function_is_one_line_naming_it_and_the_sample(funcs, name, needle):
    rs = RewardSet.load([f"{funcs}:length", f"{funcs}:{name}"])
    with pytest.raises(RewardError) as e:
        _call(rs)
    msg = str(e.value)
    assert "\n" not in msg and needle.replace("FILE", str(funcs)) in msg, msg


@pytest.mark.parametrize("spec, needle", [
    ("/no/such/file.py:f", "there is no file /no/such/file.py"),
    ("FILE:missing", "has no function 'missing'"),
    ("FILE", "name the function"),
    ("no_such_package_xyz.mod:f", "cannot import no_such_package_xyz.mod"),
    ("BROKEN:f", "importing BROKEN failed (SyntaxError"),
])
def test_a_bad_reward_spec_is_one_line(funcs, spec, needle):
    broken = funcs.parent / "broken.py"
    broken.write_text("def f(:\n")
    spec, needle = (x.replace("FILE", str(funcs)).replace("BROKEN", str(broken)) for x in (spec, needle))
    with pytest.raises(RewardError, match=re.escape(needle)) as e:
        load_reward(spec)
    assert "\n" not in str(e.value)


def test_weights_and_names_are_checked(funcs):
    with pytest.raises(RewardError, match=r"2 weight\(s\) for 1 --reward function"):
        RewardSet.load([f"{funcs}:length"], "1,2")
    with pytest.raises(RewardError, match="expected comma-separated numbers"):
        parse_weights("1,x", 2)
    with pytest.raises(RewardError, match="two --reward functions are named 'length'"):
        RewardSet.load([f"{funcs}:length", f"{funcs}:length"])
    assert parse_weights("", 3) == [1.0, 1.0, 1.0]


def test_a_module_function_and_the_builtin_math_reward():
    rs = RewardSet.load(["spirl.tasks.math_answer:math_reward", "math"][:1])
    assert rs.names == ["math_reward"]
    math_reward = load_reward("math").fn
    completions = ["so the answer is 1,234", [{"role": "assistant", "content": "it is \\boxed{\\frac{1}{2}}"}],
                   "12 then 13", "anything"]
    assert math_reward(["q"] * 4, completions, answer=["1234", "0.5", "12", "???"]) == [1.0, 1.0, 0.0, None]
    assert math_reward(["q"], ["x = 3"], solution=["$3$"]) == [1.0]  # TRL's accuracy_reward column


def test_gsm8k_scores_with_math_verify():
    from spirl.tasks.gsm8k import gold_answer, score

    assert gold_answer("... so 1,234 in all.\n#### 1,234") == "1234"
    assert score("so 1,234 in total.\n1,234", "1234") == 1.0 and score("12 then 13", "12") == 0.0
    assert score("The answer is \\boxed{72}.", "72") == 1.0 and score("no number", "72") == 0.0
