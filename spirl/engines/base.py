"""What every rollout engine takes: a `Request` (one prompt's sampling settings). What engines return,
`Sample`, sits below them, in spirl.numerics.samples (the trainer reads it too)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Request:
    """One prompt's sampling settings, for engines' `sample` (several requests with their own settings
    in one batch: the Tinker API's concurrent `sample` calls)."""

    prompt: list[int]
    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion (kept as its last token), besides the model's EOS tokens."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS tokens (only at stop_token_ids, or max_tokens)."""
