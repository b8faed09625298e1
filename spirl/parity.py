"""Trainer-side logprobs of sampled tokens, and the bitwise comparison with the engine's.

The trainer recomputes every sample (prompt + completion) in one packed forward and takes the
logprob of each completion token from the row that predicts it: token j of a completion that
follows a prompt of length P is predicted by row P - 1 + j of that sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import batch_invariant_backward as bib
from torchtitan_compat import pack

from .engines.base import Sample


def completion_rows(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows into the packed batch that predict completion tokens, those tokens), both int64."""
    rows, targets, offset = [], [], 0
    for s in samples:
        p, c = len(s.prompt_ids), len(s.completion_ids)
        rows.extend(range(offset + p - 1, offset + p - 1 + c))
        targets.extend(s.completion_ids)
        offset += p + c
    return torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long)


def _completion_logits(model, samples: list[Sample], device):
    """(logits [N, V] of the rows that predict completion tokens, those tokens [N], sizes).

    One packed forward over every sample. Only the rows that predict a completion token go
    through lm_head (every op after the decoder is row-wise, so selecting rows first changes no
    bits)."""
    packed = pack([s.ids for s in samples], device=device)
    rows, targets = completion_rows(samples)
    h = model.hidden_states(packed.tokens, packed.positions, packed.cu_seqlens, packed.max_seqlen)
    logits = bib.linear(h[rows.to(device)], model.output_weight(), model.backend)
    return logits, targets.to(device), [len(s.completion_ids) for s in samples]


def completion_logprobs(model, samples: list[Sample], device) -> list[torch.Tensor]:
    """The trainer's float32 logprob of every completion token, one tensor per sample.
    Differentiable when grad is enabled."""
    logits, targets, sizes = _completion_logits(model, samples, device)
    return list(model.token_logprobs(logits, targets).split(sizes))


@dataclass
class ParityReport:
    tokens_compared: int
    tokens_different: int
    max_abs_diff: float
    first_mismatch: tuple[int, int] | None = None
    """(sample index, completion position) of the first differing token, if any."""
    per_sample_different: list[int] = field(default_factory=list)

    @property
    def bitwise_identical(self) -> bool:
        return self.tokens_compared > 0 and self.tokens_different == 0

    def summary(self) -> str:
        head = (f"tokens compared: {self.tokens_compared}, different: {self.tokens_different}, "
                f"max |Δ|: {self.max_abs_diff:.3e}")
        if self.tokens_compared == 0:
            return head + " - NOTHING COMPARED"
        if self.bitwise_identical:
            return head + " - EXACT BITWISE MATCH"
        s, j = self.first_mismatch
        return head + f" - first mismatch: sample {s}, completion token {j}"


def compare_logprobs(engine_lps: list[torch.Tensor], trainer_lps: list[torch.Tensor]) -> ParityReport:
    """Bitwise comparison (torch.equal semantics per token: same float32 value) of two lists."""
    if len(engine_lps) != len(trainer_lps):
        raise ValueError(f"{len(engine_lps)} engine samples vs {len(trainer_lps)} trainer samples")
    compared = different = 0
    max_diff, first, per_sample = 0.0, None, []
    for i, (a, b) in enumerate(zip(engine_lps, trainer_lps)):
        a, b = a.detach().float().cpu(), b.detach().float().cpu()
        if a.shape != b.shape:
            raise ValueError(f"sample {i}: {a.numel()} engine logprobs vs {b.numel()} trainer logprobs")
        differs = a.view(torch.int32) != b.view(torch.int32)  # bit patterns, so -0.0 != 0.0 too
        n = int(differs.sum())
        compared += a.numel()
        different += n
        per_sample.append(n)
        if a.numel():
            max_diff = max(max_diff, float((a - b).abs().max()))
        if n and first is None:
            first = (i, int(differs.nonzero()[0]))
    return ParityReport(compared, different, max_diff, first, per_sample)


def completion_logprobs_and_entropy(model, samples: list[Sample], device, entropy_grad: bool = False
                                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`completion_logprobs` (the same ops, so the same bits) plus each completion token's
    float32 entropy of softmax(logits) over the vocabulary. The entropy is detached unless
    `entropy_grad` (an entropy bonus needs its gradient; a metric does not)."""
    logits, targets, sizes = _completion_logits(model, samples, device)
    lps = model.token_logprobs(logits, targets)
    z = (logits if entropy_grad else logits.detach()).float()
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return list(lps.split(sizes)), list(entropy.split(sizes))
