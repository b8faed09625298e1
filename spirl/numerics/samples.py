"""What every rollout engine returns, and what the trainer trains on.

The trainer works on *trainable sequences*: anything with
  ids        list[int]        the exact token ids the policy saw and produced, in order;
  loss_mask  list[bool]       True where the token was sampled by the policy (trained on);
  logprobs   float32 tensor   the engine's logprob of each masked-in token, in order.
A single-turn `Sample` (prompt + completion) and a multi-turn `spirl.numerics.trajectory.Trajectory`
(prompt, then sampled turns and environment replies) both are one. Below the engines (spirl/numerics):
the engines make them, the parity check and the trainer read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sample:
    """One sampled completion, in token ids (the source of truth; nothing is re-encoded)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: torch.Tensor
    """float32 [len(completion_ids)]: the engine's log p(token | prefix) under the distribution
    its logprobs mode names: `sampling` = the one that sampled (logits / T, then min-p),
    `raw` = the raw logits' (see spirl.numerics.parity.SamplingDist)."""
    finish_reason: str | None = None
    routes: torch.Tensor | None = None
    """Qwen3-MoE: the engine's expert ids, uint8 [len(ids) - 1, layers, top-k] (every token it forwarded: the last
    sampled one never is; dense layers' rows are 0), as vLLM's `CompletionOutput.routed_experts`; else None."""

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def loss_mask(self) -> list[bool]:
        return [False] * len(self.prompt_ids) + [True] * len(self.completion_ids)


def samples_by_prompt(samples: list[Sample], n: int) -> list[list[Sample]]:
    """Group a flat list (prompt-major, n per prompt) into one list per prompt."""
    if len(samples) % n:
        raise ValueError(f"{len(samples)} samples do not split into groups of {n}")
    return [samples[i:i + n] for i in range(0, len(samples), n)]
