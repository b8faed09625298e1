"""Where a step's prompts come from, and the seeds its sampling uses.

A task with `prompts(rng, n)` only is drawn from with random.Random(step_seed(seed, step)), so a step depends
only on its number; a task with `__len__` and `prompt_at` (--dataset, reasoning-gym) is read in DataOrder
(epochs of seeded shuffles) from the run's `DataCursor`, which every checkpoint records, so --resume continues
the order bit for bit. Every rank draws the round's whole list (and then samples its own share of it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..tasks.dataset import DataOrder


def step_seed(seed: int, step: int) -> int:
    """The seed of step `step`'s prompt draw (and, below 2**31, its engine's sampling seed)."""
    return (seed * 1_000_003 + step) % (2**63)


def round_seed(seed: int, step: int, r: int) -> int:
    """The engine's sampling seed of round r of a step: round 0's is the step's (as without dynamic sampling)."""
    base = step_seed(seed, step)
    return (base if r == 0 else step_seed(base, r)) % (2**31)


@dataclass
class DataCursor:
    """The position of the next prompt of an ordered task (DataOrder), recorded in every checkpoint."""

    position: int = 0


def ordered(task) -> bool:
    """The task is read in DataOrder (it has __len__ and prompt_at), not drawn with the step's RNG."""
    return callable(getattr(task, "prompt_at", None)) and callable(getattr(task, "__len__", None))


class PromptSource:
    """The prompts of each round of a step (module docstring)."""

    def __init__(self, task, seed: int, cursor: DataCursor | None = None):
        self.task, self.seed, self.cursor = task, seed, cursor if cursor is not None else DataCursor()
        self.order = DataOrder(len(task), seed) if ordered(task) else None
        self.rng = random.Random(0)

    def begin(self, step: int) -> None:
        self.rng = random.Random(step_seed(self.seed, step))

    def draw(self, n: int) -> list:
        """The next n (prompt ids, meta) of this step."""
        if self.order is None:
            return self.task.prompts(self.rng, n)
        start = self.cursor.position
        self.cursor.position += n
        return [self.task.prompt_at(self.order.index(p)) for p in range(start, start + n)]

    @property
    def position(self) -> int | None:
        """Where an ordered task's order continues (what a checkpoint records); None for a task drawn at
        random (nothing to record)."""
        return self.cursor.position if self.order is not None else None
