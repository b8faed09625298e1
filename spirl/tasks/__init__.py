"""Tasks: prompts as token ids plus a verifiable reward. Adding a task is one file, here or anywhere.

A task is made by `make(tokenizer) -> Task` and found from `--task`:
    NAME                      spirl/tasks/NAME.py (arith, gsm8k, synthetic, calculator)
    reasoning_gym:A[,B...]    a built-in task with an argument: spirl/tasks/reasoning_gym.py's
                              make(tokenizer, "A,B", cfg) (reasoning-gym's procedural datasets)
    path/to/task.py[:func]    a file anywhere: its `make` (or `func`), called with the tokenizer
    package.module:func       an importable function, called with the tokenizer
`register(name, factory)` adds one from Python (tests, notebooks). `--dataset` makes a task of a dataset
file (spirl/tasks/dataset.py).

Prompts are drawn one of two ways: a task with `prompts(rng, n)` only is drawn from with the step's seeded
RNG (a step depends only on its number); a task that also has `__len__` and `prompt_at(i)` (a dataset,
reasoning-gym) is read in epochs of seeded shuffles from a position the run keeps and checkpoints
(spirl.tasks.dataset.DataOrder). A task's reward is per sample, `reward(completion_ids, meta)`, or per
batch, `score_batch(completion_ids, metas, step, cfg)` (TRL-signature reward functions: rewards.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import random
import sys
from pathlib import Path
from typing import Any, Callable, Protocol

Meta = dict[str, Any]
RewardFn = Callable[[list[int], Meta], float]
"""A reward is a plain callable: (completion token ids, the prompt's metadata) -> float."""


class Task(Protocol):
    name: str
    reward: RewardFn

    def prompts(self, rng: random.Random, n: int) -> list[tuple[list[int], Meta]]:
        """n (prompt token ids, metadata the reward needs), drawn with `rng` only (reproducible)."""
        ...


class TaskError(ValueError):
    """A task cannot be built; one line saying why and what to do."""


_REGISTRY: dict[str, Callable[[Any], Task]] = {}
BUILTIN = ("arith", "gsm8k", "synthetic", "calculator")
WITH_ARGUMENT = ("reasoning_gym",)
"""Built-in tasks written `NAME:ARGUMENT`."""


def register(name: str, factory: Callable[[Any], Task]) -> None:
    _REGISTRY[name] = factory


def load_object(spec: str, what: str, error: type[Exception], default: str | None = None):
    """The object `spec` names: `path/to/file.py:name` (a file anywhere, imported once per process),
    `path/to/file.py` (name = `default`), or `package.module:name`. Any failure is `error` in one line."""
    target, sep, name = spec.rpartition(":")
    if not sep:
        target, name = spec, default or ""
    if not target:
        raise error(f"{what} {spec!r}: expected path/to/file.py:func or package.module:func")
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise error(f"{what} {spec!r}: there is no file {path}; pass an existing path/to/file.py")
        module_name = "_spirl_user_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
        module = sys.modules.get(module_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            try:
                loader.loader.exec_module(module)
            except Exception as e:  # noqa: BLE001 - a user's file fails in any way: said in one line
                del sys.modules[module_name]
                raise error(f"{what} {spec!r}: importing {path} failed ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:300]}); fix the file") from e
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise error(f"{what} {spec!r}: cannot import {target} ({e}); pass path/to/file.py:func or an "
                        "importable package.module:func") from None
    if not name:
        raise error(f"{what} {spec!r}: name the function, {target}:func")
    obj = getattr(module, name, None)
    if not callable(obj):
        raise error(f"{what} {spec!r}: {target} has no function {name!r}")
    return obj


def _is_task(task) -> bool:
    return callable(getattr(task, "prompts", None)) and (callable(getattr(task, "reward", None))
                                                         or callable(getattr(task, "score_batch", None)))


def get_task(name: str, tokenizer, cfg=None) -> Task:
    """The task `--task NAME` names (module docstring); `cfg` (TrainConfig) for tasks with knobs."""
    if name in _REGISTRY:
        return _REGISTRY[name](tokenizer)
    head, sep, arg = name.partition(":")
    if sep and head in WITH_ARGUMENT:
        return importlib.import_module(f"{__name__}.{head}").make(tokenizer, arg, cfg)
    if name.endswith(".py") or ":" in name or "/" in name:
        task = load_object(name, "--task", TaskError, default="make")(tokenizer)
        if not _is_task(task):
            raise TaskError(f"--task {name!r} made a {type(task).__name__}, which is not a task: it needs "
                            "prompts(rng, n) and reward(completion_ids, meta) (spirl/tasks/__init__.py)")
        return task
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise TaskError(f"unknown task {name!r}; use {', '.join(BUILTIN)}, reasoning_gym:NAME, a file "
                        f"path/to/task.py, or add spirl/tasks/{name}.py") from None
    if name in WITH_ARGUMENT:
        raise TaskError(f"--task {name} takes an argument: {name}:NAME[,NAME...] (e.g. {name}:leg_counting)")
    if not callable(getattr(module, "make", None)):
        raise TaskError(f"spirl/tasks/{name}.py is not a task (it has no make(tokenizer)); use "
                        f"{', '.join(BUILTIN)} or reasoning_gym:NAME")
    return module.make(tokenizer)


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """The chat-templated prompt as ids (thinking off: Qwen3's template pre-fills an empty think block)."""
    return chat_ids(tokenizer, [{"role": "user", "content": question}], {"enable_thinking": False})


def chat_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Chat messages through the tokenizer's chat template with the generation prompt, as ids (tokenized
    once: these ids are what is sampled from and trained on)."""
    enc = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                        **(template_kwargs or {}))
    ids = enc["input_ids"] if not isinstance(enc, list) else enc
    return [int(i) for i in ids]
