"""Reward functions with TRL's signature, loaded from `--reward SPEC`, and the scoring of a batch of completions.

A reward function is what TRL 1.16's GRPOTrainer calls (its `reward_funcs`), so functions port unchanged:

    f(prompts, completions, completion_ids, **kwargs) -> list[float | None]

    prompts         the dataset's `prompt` of each sample (a string, or a list of chat messages)
    completions     the decoded completion (skip_special_tokens=True): a string, or for chat prompts
                    [{"role": "assistant", "content": text}]
    completion_ids  the sampled token ids of each completion (list[list[int]])
    kwargs          every other dataset column (a list, one value per sample); trainer_state (a
                    transformers.TrainerState with global_step and max_steps); log_metric(name, value)
                    (logged as reward_metric/<name>, the mean of the step's values); log_extra(column,
                    values) (accepted; SPIRL keeps no completions table, so its values are not kept)
    returns         one float per sample, or None where the function does not apply to that sample

As in TRL: None becomes NaN; the sample's reward is the weighted sum over the functions that applied
(`--reward-weights`, default 1.0 each, NaN-skipping); a sample no function applied to is unscorable (NaN
reward, advantage 0). The per-function means (over the samples it applied to) are logged as reward/<name>,
name = the function's __name__.

SPEC: `path/to/file.py:func` (a file anywhere), `package.module:func` (importable), or `math` (the built-in
math-verify reward, spirl.tasks.math_answer.math_reward).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import load_object

BUILTIN = {"math": "spirl.tasks.math_answer:math_reward"}
"""Reward names that need no path."""


class RewardError(ValueError):
    """A reward function cannot be loaded, raised, or returned something that is not one number (or None) per
    sample; one line naming the function and the sample."""


@dataclass
class Scored:
    """The rewards of a batch of N completions."""

    rewards: torch.Tensor
    """float32 [N]: the weighted sum over the functions that applied; NaN where none did (unscorable)."""
    per_func: torch.Tensor
    """float32 [N, F]: each function's value; NaN where it returned None."""
    names: list[str]
    """The F functions' names (the reward/<name> scalars)."""
    metrics: dict[str, list[float]] = field(default_factory=dict)
    """log_metric(name, value) calls of the reward functions: name -> values."""
    per_function: bool = True
    """The columns are named reward functions, each logged as reward/<name> (False: a task's own reward)."""

    @classmethod
    def of_columns(cls, per_func: torch.Tensor, names: list[str], weights: list[float] | None = None,
                   metrics: dict | None = None) -> "Scored":
        """From each function's values [N, F] (NaN where it did not apply): a sample's reward is the
        `weights`-weighted sum (default 1.0 each) over the functions that applied, NaN where none did."""
        w = torch.ones(per_func.shape[1]) if weights is None else torch.tensor(weights, dtype=torch.float32)
        rewards = (per_func * w[None, :]).nansum(dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = float("nan")
        return cls(rewards, per_func, list(names), metrics if metrics is not None else {})

    @classmethod
    def single(cls, values: list[float], name: str) -> "Scored":
        """A task's own per-sample reward: one column, the rewards themselves."""
        t = torch.tensor(values, dtype=torch.float32)
        return cls(t, t[:, None].clone(), [name], per_function=False)


@dataclass
class RewardFunction:
    name: str
    fn: Callable
    spec: str


def load_reward(spec: str) -> RewardFunction:
    """A reward function from its SPEC (module docstring)."""
    fn = load_object(BUILTIN.get(spec, spec), "--reward", RewardError)
    inner = fn
    while isinstance(inner, functools.partial):  # named as TRL names it (trl.trainer.utils.get_callable_name)
        inner = inner.func
    return RewardFunction(getattr(inner, "__name__", type(inner).__name__), fn, spec)


def parse_weights(text: str, n: int) -> list[float]:
    """--reward-weights: comma-separated floats, one per --reward; empty = 1.0 each (TRL's default)."""
    if not text:
        return [1.0] * n
    try:
        weights = [float(x) for x in text.split(",")]
    except ValueError:
        raise RewardError(f"--reward-weights {text!r}: expected comma-separated numbers, e.g. 1.0,0.5") from None
    if len(weights) != n or not all(math.isfinite(w) for w in weights):
        raise RewardError(f"--reward-weights {text!r}: {len(weights)} weight(s) for {n} --reward function(s); pass "
                          f"{n} finite numbers")
    return weights


def _as_number(v: Any) -> float | None:
    """A reward value as a float (None stays None); TypeError for what is not one number. Accepted as TRL's
    torch.tensor(values, dtype=float32) accepts them: Python and NumPy numbers, bools, one-element tensors."""
    if v is None:
        return None
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, numbers.Real):
        return float(v)
    raise TypeError(f"a {type(v).__name__}, not a number")


@dataclass
class RewardSet:
    """The run's reward functions and their weights (--reward, --reward-weights)."""

    functions: list[RewardFunction]
    weights: list[float]

    @classmethod
    def load(cls, specs, weights: str = "") -> "RewardSet":
        functions = [load_reward(s) for s in specs]
        if not functions:
            raise RewardError("no reward function: pass --reward path/to/file.py:func (repeatable) or --reward math")
        names = [f.name for f in functions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RewardError(f"two --reward functions are named {twice[0]!r} (their reward/<name> scalars would "
                              "collide); give one another name")
        return cls(functions, parse_weights(weights, len(functions)))

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
                 trainer_state, where: Callable[[int | None], str] = lambda i: "the batch" if i is None else f"sample {i}"
                 ) -> Scored:
        """Score N samples: each function called once with TRL's arguments; in an error, `where(i)` names
        sample i (where(None): the batch)."""
        n = len(completion_ids)
        metrics: dict[str, list[float]] = {}

        def log_metric(name: str, value: float) -> None:
            metrics.setdefault(str(name), []).append(float(value))

        def log_extra(column: str, values: list) -> None:  # no completions table here (module docstring)
            return None

        per_func = torch.full((n, len(self.functions)), float("nan"), dtype=torch.float32)
        for j, f in enumerate(self.functions):
            try:
                out = f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                           trainer_state=trainer_state, log_metric=log_metric, log_extra=log_extra)
            except Exception as e:  # noqa: BLE001 - user code fails in any way; said in one line
                raise RewardError(f"reward function {f.name} ({f.spec}) raised {type(e).__name__}: "
                                  f"{' '.join(str(e).split())[:300]} on {where(None)}; fix the function") from e
            try:
                out = list(out)
            except TypeError:
                raise RewardError(f"reward function {f.name} ({f.spec}) returned {type(out).__name__}, not a list of "
                                  f"{n} numbers (one per sample, None where it does not apply)") from None
            if len(out) != n:
                raise RewardError(f"reward function {f.name} ({f.spec}) returned {len(out)} values for {n} samples; "
                                  "return one per sample (None where it does not apply)")
            for i, v in enumerate(out):
                try:
                    x = _as_number(v)
                except TypeError as e:
                    raise RewardError(f"reward function {f.name} ({f.spec}) returned {v!r} ({e}) for {where(i)}; "
                                      "return a number or None") from None
                if x is not None and not math.isfinite(x):
                    raise RewardError(f"reward function {f.name} ({f.spec}) returned {x} for {where(i)}; return a "
                                      "finite number or None")
                per_func[i, j] = float("nan") if x is None else x
        return Scored.of_columns(per_func, self.names, self.weights, metrics)


def trainer_state(step: int, cfg=None) -> Any:
    """The transformers.TrainerState a TRL reward function reads: global_step = the optimizer steps taken
    before step `step`'s rollout, max_steps = those of the whole run (cfg: TrainConfig; None: 0)."""
    from transformers import TrainerState

    updates = getattr(cfg, "updates_per_batch", 1)
    return TrainerState(global_step=max(step - 1, 0) * updates, max_steps=getattr(cfg, "steps", 0) * updates)


def score(task, outputs: list, metas: list[dict], step: int = 0, cfg=None) -> Scored:
    """The rewards of N outputs of `task`: completion ids (or, for a multi-turn task, its trajectories). A
    batch scorer `task.score_batch(completion_ids, metas, step, cfg)` if the task has one, else the task's
    per-sample `reward(output, meta)`; a task from outside the package whose reward fails or is not a number
    is a RewardError naming the sample (SPIRL's own tasks failing is a bug, reported as one)."""
    if hasattr(task, "score_batch"):
        return task.score_batch(outputs, metas, step, cfg)
    ours = type(task).__module__.startswith("spirl.")
    values = []
    for i, (out, meta) in enumerate(zip(outputs, metas)):
        try:
            v = task.reward(out, meta)
            x = _as_number(v)
        except Exception as e:  # noqa: BLE001 - an external task's reward fails in any way; one line
            if ours:
                raise
            raise RewardError(f"task {getattr(task, 'name', task)!r}: its reward raised {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]} on step {step}, sample {i}") from e
        if x is None or not math.isfinite(x):
            raise RewardError(f"task {getattr(task, 'name', task)!r}: its reward returned {v!r} on step {step}, "
                              f"sample {i}; a task's reward is one finite number")
        values.append(x)
    return Scored.single(values, getattr(task, "name", "task"))
