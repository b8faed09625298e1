"""Two-digit addition: 'What is 23+45? Answer with the number only.'

Reward: 1.0 if the completion's first integer is the sum; 0.1 if the completion starts with a
digit (shaping, so that a weak model that has not yet got the sum right still gets a signal for
the answer format); else 0.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from . import Meta, chat_prompt_ids

POOL_SIZE = 1024
POOL_SEED = 1234
"""The question pool is fixed (independent of the run seed) and tokenized once at start."""
_FIRST_INT = re.compile(r"-?\d+")


def score(text: str, answer: int) -> float:
    m = _FIRST_INT.search(text)
    if m and int(m.group()) == answer:
        return 1.0
    return 0.1 if text.lstrip()[:1].isdigit() else 0.0


@dataclass
class ArithTask:
    tokenizer: object
    name: str = "arith"
    pool: list[tuple[list[int], Meta]] = field(default_factory=list)

    def __post_init__(self):
        rng = random.Random(POOL_SEED)
        for _ in range(POOL_SIZE):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            q = f"What is {a}+{b}? Answer with the number only."
            self.pool.append((chat_prompt_ids(self.tokenizer, q), {"answer": a + b}))

    def prompts(self, rng: random.Random, n: int) -> list[tuple[list[int], Meta]]:
        return [self.pool[rng.randrange(len(self.pool))] for _ in range(n)]

    def reward(self, completion_ids: list[int], meta: Meta) -> float:
        # decoding only to score; training uses the sampled ids themselves
        return score(self.tokenizer.decode(completion_ids, skip_special_tokens=True), meta["answer"])


def make(tokenizer) -> ArithTask:
    return ArithTask(tokenizer)
