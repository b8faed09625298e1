"""Trainer-side logprobs of sampled tokens, and the bitwise comparison with the engine's.

The trainer recomputes every trainable sequence (a single-turn Sample or a multi-turn
Trajectory: `ids`, `loss_mask`, `logprobs`, see spirl.engines.base) in one packed forward and
takes the logprob of each sampled token (loss_mask True) from the row that predicts it: token i
of a sequence is predicted by row i - 1 of that sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchtitan_compat import pack

from .engines.base import Sample


def sampled_rows(seqs: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(rows into the packed batch that predict sampled tokens, those tokens, per-sequence counts).

    Works from each sequence's `loss_mask`, so a prompt + completion and a multi-turn trajectory
    (sampled turns between environment replies) are handled alike."""
    rows, targets, sizes, offset = [], [], [], 0
    for i, s in enumerate(seqs):
        ids, mask = s.ids, s.loss_mask
        if len(mask) != len(ids):
            raise ValueError(f"sequence {i}: loss_mask has {len(mask)} entries for {len(ids)} tokens")
        if mask and mask[0]:
            raise ValueError(f"sequence {i}: its first token is marked sampled, but nothing predicts it")
        picked = [j for j, m in enumerate(mask) if m]
        rows.extend(offset + j - 1 for j in picked)
        targets.extend(ids[j] for j in picked)
        sizes.append(len(picked))
        offset += len(ids)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long), sizes


@dataclass(frozen=True)
class SamplingDist:
    """Which distribution's logprobs: the sampler's (`--logprobs sampling`: logits / temperature,
    then min-p, exactly as vLLM's V2 sampler and its `processed_logprobs`) or the raw logits'
    (`--logprobs raw`: the default-constructed RAW)."""

    temperature: float = 1.0
    min_p: float = 0.0


RAW = SamplingDist()


def logprob_dist(mode: str, temperature: float, min_p: float = 0.0) -> SamplingDist:
    """The distribution a `--logprobs` mode (`sampling` or `raw`) names, for samples drawn with
    these settings."""
    return SamplingDist(temperature, min_p) if mode == "sampling" else RAW


def _logprobs(model, seqs, device, dist: SamplingDist, entropy: bool):
    """One packed forward over every sequence; the logprob (and entropy) of each sampled token."""
    packed = pack([s.ids for s in seqs], device=device)
    rows, targets, sizes = sampled_rows(seqs)
    lps, ent = model.token_logprobs(packed.tokens, packed.positions, packed.cu_seqlens, packed.max_seqlen,
                                    rows.to(device), targets.to(device), dist.temperature, dist.min_p,
                                    entropy=entropy)
    return list(lps.split(sizes)), (list(ent.split(sizes)) if entropy else None)


def sampled_logprobs(model, seqs: list[Sample], device, dist: SamplingDist = RAW) -> list[torch.Tensor]:
    """The trainer's float32 logprob of every sampled token under `dist`, one tensor per
    sequence. Differentiable when grad is enabled."""
    return _logprobs(model, seqs, device, dist, entropy=False)[0]


@dataclass
class ParityReport:
    tokens_compared: int
    tokens_different: int
    max_abs_diff: float
    first_mismatch: tuple[int, int] | None = None
    """(sequence index, index among its sampled tokens) of the first differing token, if any."""
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
        return head + f" - first mismatch: sequence {s}, sampled token {j}"


def compare_logprobs(engine_lps: list[torch.Tensor], trainer_lps: list[torch.Tensor]) -> ParityReport:
    """Bitwise comparison (torch.equal semantics per token: same float32 value) of two lists."""
    if len(engine_lps) != len(trainer_lps):
        raise ValueError(f"{len(engine_lps)} engine sequences vs {len(trainer_lps)} trainer sequences")
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


def sampled_logprobs_and_entropy(model, seqs: list[Sample], device, dist: SamplingDist = RAW,
                                 entropy_grad: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`sampled_logprobs` (the same ops, so the same bits) plus the float32 entropy of `dist` at
    each sampled token's row. The entropy is detached unless `entropy_grad` (an entropy bonus
    needs its gradient; a metric does not)."""
    lps, ent = _logprobs(model, seqs, device, dist, entropy=True)
    return lps, ent if entropy_grad else [e.detach() for e in ent]
