"""Math answers checked with math-verify (0.9): the completion's answer parsed and compared with the gold one
symbolically (fractions, LaTeX, \\boxed{}, thousands separators...), as the field scores math.

`score(text, gold)` is gsm8k's reward; `math_reward` is the same check as a TRL-signature reward function
(`--reward math`) for a dataset with an `answer` (or `solution`) column.
"""

from __future__ import annotations


def score(text: str, gold: str) -> float:
    """1.0 if math-verify finds the completion's answer (its last expression, or a \\boxed{} one) equal to
    `gold`, else 0.0."""
    from math_verify import parse, verify

    gold_parsed = parse(str(gold))
    return 1.0 if gold_parsed and verify(gold_parsed, parse(text)) else 0.0


def _text(completion) -> str:
    """A TRL completion: a string, or [{"role": "assistant", "content": text}] for chat prompts."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if isinstance(m, dict))


def math_reward(prompts, completions, completion_ids=None, answer=None, solution=None, **kwargs) -> list[float | None]:
    """1.0 / 0.0 per completion: math-verify's verdict against the sample's `answer` column (or `solution`, TRL's
    accuracy_reward's column); None for a sample whose gold answer math-verify cannot parse (TRL: not applicable)."""
    from math_verify import parse, verify

    gold = answer if answer is not None else solution
    if gold is None:
        raise ValueError("the math reward needs an `answer` (or `solution`) column in the dataset")
    out: list[float | None] = []
    for completion, g in zip(completions, gold):
        parsed = parse(str(g))
        out.append(None if not parsed else (1.0 if verify(parsed, parse(_text(completion))) else 0.0))
    return out
