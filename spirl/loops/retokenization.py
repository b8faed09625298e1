"""Smoking-gun detector: what naive retokenization (decode -> chat template -> encode) would train on.

    CLI: python compare/retokenization.py --rollouts runs/RUN/rollouts/step_000001.jsonl --model DIR

For every multi-turn trajectory (token ids in, token ids out: spirl.numerics.trajectory) this builds the
sequence a text-based pipeline would train on instead: each sampled turn decoded to text (special
tokens kept, the most charitable decode), the conversation re-rendered with the chat template,
the text encoded again. The two id sequences are aligned (difflib on token ids) and every region
where they differ is reported. Each naive token in such a region is scored under the model (its
logprob given the naive prefix); a token the naive pipeline would train on (inside an assistant
block) with logprob < threshold (default -15) is a *smoking gun*: a token the policy never
sampled, whose gradient weight exp(-lp) dwarfs everything else in the batch.

The TI/TO side of the same rollouts: SPIRL trains on the sampled ids themselves (the rollout loop
checks that every turn's engine prompt is the trajectory so far, and the trainer's parity check
compares every sampled token), so no token differs; what is reported for it is how many of the
tokens the policy really sampled have a logprob below the threshold.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch

SMOKING_GUN_LOGPROB = -15.0


@dataclass
class NaiveSequence:
    ids: list[int]
    loss_mask: list[bool]
    """Tokens inside assistant blocks (after `<|im_start|>assistant\\n`, up to and including
    `<|im_end|>`): what a text pipeline marks as trainable."""


@dataclass
class DiffRegion:
    sequence: int
    op: str
    """difflib opcode: replace (merge/split/other), delete (TI/TO only), insert (naive only)."""
    tito: tuple[int, int]
    naive: tuple[int, int]
    tito_ids: list[int]
    naive_ids: list[int]
    naive_trained: list[bool]
    naive_logprobs: list[float] = field(default_factory=list)

    def smoking_guns(self, threshold: float) -> int:
        return sum(1 for t, lp in zip(self.naive_trained, self.naive_logprobs) if t and lp < threshold)


@dataclass
class DetectorSummary:
    sequences: int = 0
    sequences_differing: int = 0
    regions: int = 0
    naive_tokens_differing: int = 0
    naive_trained_tokens_differing: int = 0
    smoking_guns: int = 0
    min_naive_logprob: float = 0.0
    tito_sampled_tokens: int = 0
    tito_sampled_below_threshold: int = 0

    def metrics(self) -> dict[str, float]:
        return {f"retok/{k}": float(v) for k, v in self.__dict__.items()}


def naive_messages(traj, prompt_messages: list[dict], tokenizer, turn_end_id: int) -> list[dict]:
    """The conversation as a text pipeline stores it: prompt messages, then decoded turns and the
    environment's reply texts."""
    msgs = [dict(m) for m in prompt_messages]
    for seg in traj.segments[1:]:
        if seg.sampled:
            ids = seg.ids[:-1] if seg.ids and seg.ids[-1] == turn_end_id else seg.ids
            msgs.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=False)})
        else:
            if seg.text is None:
                raise ValueError("an environment segment has no text: the naive pipeline needs the reply text")
            msgs.append({"role": "tool", "content": seg.text})
    return msgs


def assistant_mask(ids: list[int], tokenizer) -> list[bool]:
    start, role, nl, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "assistant", "\u010a", "<|im_end|>"])
    mask, inside, i = [False] * len(ids), False, 0
    while i < len(ids):
        if not inside and ids[i:i + 3] == [start, role, nl]:
            inside, i = True, i + 3
            continue
        if inside:
            mask[i] = True
            inside = ids[i] != end
        i += 1
    return mask


def naive_retokenize(traj, prompt_messages: list[dict], fmt) -> NaiveSequence:
    """decode -> chat template -> encode, as a text-based multi-turn pipeline does."""
    tok = fmt.tokenizer
    text = fmt.render_text(naive_messages(traj, prompt_messages, tok, fmt.turn_end_id))
    ids = [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]
    return NaiveSequence(ids, assistant_mask(ids, tok))


def diff_regions(index: int, tito_ids: list[int], naive: NaiveSequence) -> list[DiffRegion]:
    sm = difflib.SequenceMatcher(None, tito_ids, naive.ids, autojunk=False)
    return [DiffRegion(index, op, (i1, i2), (j1, j2), tito_ids[i1:i2], naive.ids[j1:j2], naive.loss_mask[j1:j2])
            for op, i1, i2, j1, j2 in sm.get_opcodes() if op != "equal"]


@dataclass
class _Scored:
    """A sequence whose `loss_mask` marks the positions to score (spirl.numerics.parity's interface)."""
    ids: list[int]
    loss_mask: list[bool]


@torch.no_grad()
def score_regions(model, naive_seqs: list[NaiveSequence], regions: list[DiffRegion], device,
                  chunk_tokens: int = 32768) -> None:
    """Fill each region's naive_logprobs: log p(naive token | naive prefix) under `model`."""
    from spirl.numerics.parity import sampled_logprobs

    wanted: dict[int, set[int]] = {}
    for r in regions:
        wanted.setdefault(r.sequence, set()).update(j for j in range(*r.naive) if j > 0)
    order = sorted(wanted)
    scored: dict[tuple[int, int], float] = {}
    batch, size = [], 0
    for k, idx in enumerate(order):
        batch.append(idx)
        size += len(naive_seqs[idx].ids)
        if size >= chunk_tokens or k == len(order) - 1:
            seqs = [_Scored(naive_seqs[i].ids, [j in wanted[i] for j in range(len(naive_seqs[i].ids))]) for i in batch]
            for i, s, lps in zip(batch, seqs, sampled_logprobs(model, seqs, device)):
                pos = [j for j, m in enumerate(s.loss_mask) if m]
                scored.update({(i, j): float(v) for j, v in zip(pos, lps.float().cpu().tolist())})
            batch, size = [], 0
    for r in regions:  # position 0 has no prediction: it is never a smoking gun
        r.naive_logprobs = [scored.get((r.sequence, j), 0.0) for j in range(*r.naive)]


def detect(trajs, prompt_messages: list[list[dict]], fmt, model, device,
           threshold: float = SMOKING_GUN_LOGPROB) -> tuple[DetectorSummary, list[DiffRegion]]:
    """Run the detector on trajectories (with each one's prompt messages); score under `model`."""
    naive = [naive_retokenize(t, m, fmt) for t, m in zip(trajs, prompt_messages)]
    regions = [r for i, (t, n) in enumerate(zip(trajs, naive)) for r in diff_regions(i, t.ids, n)]
    score_regions(model, naive, regions, device)
    s = DetectorSummary(sequences=len(trajs))
    s.sequences_differing = len({r.sequence for r in regions})
    s.regions = len(regions)
    s.naive_tokens_differing = sum(len(r.naive_ids) for r in regions)
    s.naive_trained_tokens_differing = sum(sum(r.naive_trained) for r in regions)
    s.smoking_guns = sum(r.smoking_guns(threshold) for r in regions)
    s.min_naive_logprob = min((lp for r in regions for lp in r.naive_logprobs), default=0.0)
    lps = [t.logprobs for t in trajs]
    s.tito_sampled_tokens = sum(x.numel() for x in lps)
    s.tito_sampled_below_threshold = sum(int((x < threshold).sum()) for x in lps)
    return s, regions
