"""Sample filters (--filter, --dynamic-sampling) and over-sampling (--oversample): which groups a step trains on.

A filter looks at one group (the --group-size samples of one prompt, with their rewards) and keeps it or drops it.
A step trains on the first --prompts-per-step groups that every filter keeps, in the order they were sampled;
dropped groups are replaced by groups of new prompts sampled in further rounds (spirl/loops/rollout.py), up to
--dynamic-sampling-max-rounds. With --oversample F each round samples ceil(--prompts-per-step x F) prompts, so that
one round usually leaves enough. What is kept depends on the samples and rewards alone, which --seed and the
schedule fix: a run with filters repeats and resumes bit for bit like any other.

Built-ins (SPEC, logged as filter/<name>/dropped):
    reward_spread      at least two scorable rewards differ (DAPO's dynamic sampling: --dynamic-sampling 1)
    min_reward:X       the group's best scorable reward is at least X (a group no sample solves is dropped)
    diversity:F        distinct completions (by token ids) / group size is at least F (0 < F <= 1)
    length:LO-HI       every completion has LO to HI tokens (either bound may be left out: length:-512, length:8-)

A filter of your own, `path/to/file.py:func` or `package.module:func`, is called once per group with TRL's
reward-function arguments (spirl/tasks/rewards.py) and the group's rewards:

    keep = func(prompts, completions, completion_ids, rewards, **kwargs) -> bool

    prompts         each sample's prompt: the dataset's `prompt` (--dataset), else the prompt ids decoded
    completions     each completion decoded (skip_special_tokens=True)
    completion_ids  each completion's sampled token ids
    rewards         each sample's reward, None where no reward function applied
    kwargs          step (the step number) and, with --dataset, every other column (one value per sample)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..tasks import load_object
from ..tasks.dataset import columns_of


class FilterError(ValueError):
    """A --filter cannot be parsed or loaded, or a filter function failed; one line saying what to do."""


@dataclass
class Group:
    """One prompt's samples of a round, with their rewards (float32 [G], NaN: unscorable) and metas."""

    samples: list
    metas: list
    rewards: torch.Tensor
    per_func: torch.Tensor


@dataclass
class GroupFilter:
    name: str
    """Its name in filter/<name>/dropped."""
    keep: Callable[[Group, int], bool]
    """(group, step) -> whether the step may train on the group."""


def reward_spread(group: Group, step: int) -> bool:
    r = group.rewards[~torch.isnan(group.rewards)]
    return r.numel() >= 2 and bool((r != r[0]).any())


def _number(spec: str, arg: str, low: float, high: float) -> float:
    try:
        x = float(arg)
    except ValueError:
        x = float("nan")
    if not (math.isfinite(x) and low <= x <= high):
        raise FilterError(f"--filter {spec!r}: {arg!r} is not a number in [{low:g}, {high:g}]")
    return x


def _length_bounds(spec: str, arg: str) -> tuple[int, float]:
    lo, sep, hi = arg.partition("-")
    try:
        bounds = (int(lo) if lo else 0, int(hi) if hi else math.inf)
    except ValueError:
        bounds = (-1, -1)
    if not sep or bounds[0] < 0 or bounds[1] < bounds[0]:
        raise FilterError(f"--filter {spec!r}: write length:LO-HI with token counts LO <= HI (length:8-512, "
                          "length:-512 or length:8-)")
    return bounds


def builtin(spec: str) -> GroupFilter | None:
    """The built-in filter SPEC names, or None when SPEC names none (a function's SPEC)."""
    name, _, arg = spec.partition(":")
    if name == "reward_spread":
        if arg:
            raise FilterError(f"--filter {spec!r}: reward_spread takes no argument")
        return GroupFilter("reward_spread", reward_spread)
    if name == "min_reward":
        x = _number(spec, arg, -math.inf, math.inf)
        return GroupFilter(f"min_reward_{arg}", lambda g, step: bool((g.rewards[~torch.isnan(g.rewards)] >= x).any()))
    if name == "diversity":
        f = _number(spec, arg, 1e-9, 1.0)
        return GroupFilter(f"diversity_{arg}",
                           lambda g, step: len({tuple(s.completion_ids) for s in g.samples}) >= f * len(g.samples))
    if name == "length":
        lo, hi = _length_bounds(spec, arg)
        return GroupFilter(f"length_{arg}", lambda g, step: all(lo <= len(s.completion_ids) <= hi for s in g.samples))
    return None


def function_filter(spec: str, tokenizer) -> GroupFilter:
    """A filter function from a file or module (module docstring), its arguments built per group."""
    fn = load_object(spec, "--filter", FilterError)
    name = getattr(fn, "__name__", type(fn).__name__)

    def keep(group: Group, step: int) -> bool:
        ids = [list(s.completion_ids) for s in group.samples]
        prompts = [m["prompt"] if "prompt" in m else tokenizer.decode(s.prompt_ids)
                   for s, m in zip(group.samples, group.metas)]
        columns = columns_of(group.metas)
        rewards = [None if math.isnan(float(r)) else float(r) for r in group.rewards]
        try:
            out = fn(prompts=prompts, completions=tokenizer.batch_decode(ids, skip_special_tokens=True),
                     completion_ids=ids, rewards=rewards, step=step, **columns)
        except Exception as e:  # noqa: BLE001 - user code fails in any way; said in one line
            raise FilterError(f"filter {name} ({spec}) raised {type(e).__name__}: {' '.join(str(e).split())[:300]} "
                              f"on a group of step {step}; fix the function") from e
        if not isinstance(out, bool) and type(out).__name__ != "bool_":  # Python's or NumPy's bool
            raise FilterError(f"filter {name} ({spec}) returned {type(out).__name__}, not a bool (True: keep the "
                              "group)")
        return bool(out)

    return GroupFilter(name, keep)


def load_filters(cfg, tokenizer, multi_turn: bool = False) -> list[GroupFilter]:
    """The run's filters: reward_spread for --dynamic-sampling 1, then each --filter in order (a name given twice
    is refused). Multi-turn tasks take reward_spread and min_reward only (their samples are trajectories)."""
    specs = (("reward_spread",) if cfg.dynamic_sampling else ()) + tuple(cfg.filter)
    filters: list[GroupFilter] = []
    for spec in dict.fromkeys(specs):  # --dynamic-sampling 1 with --filter reward_spread: once
        f = builtin(spec)
        if multi_turn and (f is None or not f.name.startswith(("reward_spread", "min_reward"))):
            raise FilterError(f"--filter {spec!r} with a multi-turn task: only reward_spread and min_reward:X look at "
                              "what a trajectory has; drop the filter")
        filters.append(f if f is not None else function_filter(spec, tokenizer))
    names = [f.name for f in filters]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise FilterError(f"two --filter entries are named {twice[0]!r} (their filter/<name>/dropped scalars would "
                          "collide); rename one function")
    return filters

