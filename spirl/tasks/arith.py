"""Two-digit addition: 'What is 23+45? Answer with the number only.'

Problems: all 8,100 pairs 10 <= a, b <= 99, shuffled once with a fixed seed (independent of the
run seed). The first EVAL_SIZE pairs are the held-out eval set (`eval_problems`); training
prompts (and the supervised warm start, `spirl.loops.warmstart --task arith`) draw only from the rest,
so an eval problem is never trained on.

Reward: 1.0 if the completion's first integer is the sum; 0.1 if the completion starts with a
digit (shaping, so that a weak model that has not yet got the sum right still gets a signal for
the answer format); else 0. A completion is *correct* (eval accuracy) when its reward is 1.0.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from . import Meta, chat_prompt_ids

POOL_SEED = 1234
"""Seed of the one fixed shuffle of all pairs (the eval/train split never depends on the run seed)."""
EVAL_SIZE = 500
"""Held-out problems: the first EVAL_SIZE pairs of the shuffle."""
_FIRST_INT = re.compile(r"-?\d+")


def score(text: str, answer: int) -> float:
    m = _FIRST_INT.search(text)
    if m and int(m.group()) == answer:
        return 1.0
    return 0.1 if text.lstrip()[:1].isdigit() else 0.0


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}? Answer with the number only."


def all_pairs() -> list[tuple[int, int]]:
    """Every (a, b), in the fixed shuffled order: eval pairs first."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(POOL_SEED).shuffle(pairs)
    return pairs


def carry_free_sum(a: int, b: int) -> int:
    """The sum a teacher that forgets every carry writes: each digit (a_i + b_i) mod 10."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


@dataclass
class ArithTask:
    tokenizer: object
    name: str = "arith"
    pool: list[tuple[list[int], Meta]] = field(default_factory=list)
    """Training prompts (ids, {"answer", "a", "b"})."""
    eval_pool: list[tuple[list[int], Meta]] = field(default_factory=list)

    def __post_init__(self):
        pairs = all_pairs()
        encoded = [(chat_prompt_ids(self.tokenizer, question(a, b)), {"answer": a + b, "a": a, "b": b})
                   for a, b in pairs]
        self.eval_pool, self.pool = encoded[:EVAL_SIZE], encoded[EVAL_SIZE:]

    def prompts(self, rng: random.Random, n: int) -> list[tuple[list[int], Meta]]:
        return [self.pool[rng.randrange(len(self.pool))] for _ in range(n)]

    def eval_problems(self) -> list[tuple[list[int], Meta]]:
        """The fixed held-out set (EVAL_SIZE problems, disjoint from `pool`)."""
        return self.eval_pool

    def reward(self, completion_ids: list[int], meta: Meta) -> float:
        # decoding only to score; training uses the sampled ids themselves
        return score(self.tokenizer.decode(completion_ids, skip_special_tokens=True), meta["answer"])


def make(tokenizer) -> ArithTask:
    return ArithTask(tokenizer)
