"""A multi-turn episode as token ids: the trained sequence is exactly what the policy saw.

    [prompt][turn 1 (sampled)][env reply 1][turn 2 (sampled)][env reply 2]...[turn K (sampled)]

* the prompt is rendered once by the chat template (tools, system, user, generation prompt);
* each turn is the engine's sampled ids, kept as they are, with the engine's logprobs;
* each environment reply is tokenized on its own (spirl.core.chat_format), boundary tokens included.
Nothing is decoded and re-encoded, so the ids the trainer scores are the ids the engine sampled,
and the loss mask covers exactly the sampled ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch


@dataclass
class Segment:
    ids: list[int]
    sampled: bool
    """True for a policy turn (trained on, has logprobs); False for prompt and env replies."""
    logprobs: torch.Tensor | None = None
    """float32 [len(ids)] for a sampled segment: the engine's logprob of each token."""
    text: str | None = None
    """An env reply's content as the environment wrote it (for logs and the naive-retokenization
    detector in compare/); the ids above are what is trained on, never this text re-encoded."""


@dataclass
class Trajectory:
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str | None = None
    """Why the episode ended: answered, max_turns, length (a turn hit max_new_tokens), eos, ..."""
    env_errors: int = 0
    """Malformed tool calls the environment answered with an error message."""

    @classmethod
    def start(cls, prompt_ids: list[int]) -> "Trajectory":
        if not prompt_ids:
            raise ValueError("a trajectory needs a non-empty prompt (the first token has no prediction)")
        return cls([Segment(list(prompt_ids), sampled=False)])

    def add_turn(self, ids: list[int], logprobs: torch.Tensor) -> None:
        if len(ids) != logprobs.numel():
            raise ValueError(f"turn of {len(ids)} tokens has {logprobs.numel()} logprobs")
        self.segments.append(Segment(list(ids), True, logprobs.detach().to(torch.float32).cpu()))

    def add_env(self, ids: list[int], text: str | None = None) -> None:
        self.segments.append(Segment(list(ids), sampled=False, text=text))

    @property
    def ids(self) -> list[int]:
        return list(chain.from_iterable(s.ids for s in self.segments))

    @property
    def loss_mask(self) -> list[bool]:
        return list(chain.from_iterable([s.sampled] * len(s.ids) for s in self.segments))

    @property
    def sampled_ids(self) -> list[int]:
        return [t for s in self.segments if s.sampled for t in s.ids]

    @property
    def turns(self) -> list[list[int]]:
        return [s.ids for s in self.segments if s.sampled]

    @property
    def logprobs(self) -> torch.Tensor:
        parts = [s.logprobs for s in self.segments if s.sampled]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)

    @logprobs.setter
    def logprobs(self, values: torch.Tensor) -> None:
        """Replace the logprobs of every sampled token (in order); used by engines that rescore."""
        sizes = [len(s.ids) for s in self.segments if s.sampled]
        if values.numel() != sum(sizes):
            raise ValueError(f"{values.numel()} logprobs for {sum(sizes)} sampled tokens")
        parts = iter(values.detach().to(torch.float32).cpu().split(sizes))
        for s in self.segments:
            if s.sampled:
                s.logprobs = next(parts)

    def to_json(self) -> dict:
        return {"segments": [{"ids": s.ids, "sampled": s.sampled,
                              "logprobs": None if s.logprobs is None else s.logprobs.tolist(), "text": s.text}
                             for s in self.segments],
                "finish_reason": self.finish_reason, "env_errors": self.env_errors}

    @classmethod
    def from_json(cls, d: dict) -> "Trajectory":
        segs = [Segment(s["ids"], s["sampled"], None if s["logprobs"] is None
                        else torch.tensor(s["logprobs"], dtype=torch.float32), s.get("text"))
                for s in d["segments"]]
        return cls(segs, d.get("finish_reason"), d.get("env_errors", 0))
