"""GSM8K (openai/gsm8k, train split) through the optional `datasets` package.

Reward: 1.0 if math-verify finds the completion's answer equal to the reference answer (after '####'; its
last number, or a \\boxed{} one: spirl.tasks.math_answer), else 0. Prompts are tokenized on first use and
cached, never re-encoded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from . import Meta, TaskError, chat_prompt_ids
from .math_answer import score

SUFFIX = " Give the final answer as a number on the last line."


def gold_answer(solution: str) -> str:
    """The reference answer of a GSM8K solution: what follows '####', without thousands separators."""
    return solution.split("####")[-1].strip().replace(",", "")


@dataclass
class GSM8KTask:
    tokenizer: object
    rows: list
    name: str = "gsm8k"
    _cache: dict = field(default_factory=dict)

    def _prompt(self, i: int) -> tuple[list[int], Meta]:
        if i not in self._cache:
            row = self.rows[i]
            self._cache[i] = (chat_prompt_ids(self.tokenizer, row["question"] + SUFFIX),
                              {"answer": gold_answer(row["answer"])})
        return self._cache[i]

    def prompts(self, rng: random.Random, n: int) -> list[tuple[list[int], Meta]]:
        return [self._prompt(rng.randrange(len(self.rows))) for _ in range(n)]

    def reward(self, completion_ids: list[int], meta: Meta) -> float:
        return score(self.tokenizer.decode(completion_ids, skip_special_tokens=True), meta["answer"])


def make(tokenizer) -> GSM8KTask:
    try:
        import datasets
    except ImportError:
        raise TaskError("task gsm8k needs the `datasets` package (pip install datasets); or use --task arith") from None
    try:
        rows = datasets.load_dataset("openai/gsm8k", "main", split="train")
    except Exception as e:  # offline, hub down, ...
        raise TaskError(f"could not load openai/gsm8k ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                        "check network/HF_DATASETS_OFFLINE or use --task arith") from None
    return GSM8KTask(tokenizer, list(rows))
