"""Tasks: prompts as token ids plus a verifiable reward. Adding a task is one file in this package.

A task module defines `make(tokenizer) -> Task` and is found by name (`--task NAME` imports
`spirl.tasks.NAME`); `register(name, factory)` adds one from elsewhere (tests, notebooks).
"""

from __future__ import annotations

import importlib
import random
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


def register(name: str, factory: Callable[[Any], Task]) -> None:
    _REGISTRY[name] = factory


def get_task(name: str, tokenizer) -> Task:
    if name in _REGISTRY:
        return _REGISTRY[name](tokenizer)
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise TaskError(f"unknown task {name!r}; use arith, gsm8k, synthetic or add spirl/tasks/{name}.py") from None
    if not callable(getattr(module, "make", None)):
        raise TaskError(f"spirl/tasks/{name}.py is not a task (it has no make(tokenizer)); use arith, gsm8k, synthetic, calculator")
    return module.make(tokenizer)


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """The chat-templated prompt as ids (thinking off: Qwen3's template pre-fills an empty think block)."""
    enc = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                        add_generation_prompt=True, enable_thinking=False)
    ids = enc["input_ids"] if not isinstance(enc, list) else enc
    return [int(i) for i in ids]
