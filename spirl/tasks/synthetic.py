"""A plumbing task for random-weight checkpoints (CI, demos): reward = the fraction of completion
tokens whose id is even. Meaningless as language, but dense, verifiable and learnable by a tiny
random model within a few steps (it only has to shift its output distribution)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from . import Meta, chat_prompt_ids


@dataclass
class SyntheticTask:
    tokenizer: object
    name: str = "synthetic"
    pool: list[tuple[list[int], Meta]] = field(default_factory=list)

    def __post_init__(self):
        self.pool = [(chat_prompt_ids(self.tokenizer, f"Say something even, #{i}."), {}) for i in range(16)]

    def prompts(self, rng: random.Random, n: int) -> list[tuple[list[int], Meta]]:
        return [self.pool[rng.randrange(len(self.pool))] for _ in range(n)]

    def reward(self, completion_ids: list[int], meta: Meta) -> float:
        return sum(1 for t in completion_ids if t % 2 == 0) / max(len(completion_ids), 1)


def make(tokenizer) -> SyntheticTask:
    return SyntheticTask(tokenizer)
