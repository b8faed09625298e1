"""Smoking-gun detector: what naive retokenization (decode -> chat template -> encode) would train on.

    python compare/retokenization.py --rollouts runs/RUN/rollouts/step_000001.jsonl --model DIR

For every multi-turn trajectory (token ids in, token ids out: spirl.trajectory) this builds the
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
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

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
    """A sequence whose `loss_mask` marks the positions to score (spirl.parity's interface)."""
    ids: list[int]
    loss_mask: list[bool]


@torch.no_grad()
def score_regions(model, naive_seqs: list[NaiveSequence], regions: list[DiffRegion], device,
                  chunk_tokens: int = 32768) -> None:
    """Fill each region's naive_logprobs: log p(naive token | naive prefix) under `model`."""
    from spirl.parity import sampled_logprobs

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


# -- report -----------------------------------------------------------------------------------


def _text(tokenizer, ids: list[int], width: int) -> str:
    s = "|".join(repr(tokenizer.decode([i], skip_special_tokens=False))[1:-1] for i in ids)
    return s if len(s) <= width else s[:width - 1] + "…"


def format_table(regions: list[DiffRegion], tokenizer, threshold: float, limit: int) -> list[str]:
    header = (f"{'seq':>4} {'op':<7} {'TI/TO pos':>11} {'naive pos':>11} {'TI/TO tokens':<26} "
              f"{'naive tokens':<26} {'naive logprob (trained *)':<28} gun")
    lines = [header, "-" * len(header)]
    for r in regions[:limit]:
        lps = " ".join(f"{lp:.1f}{'*' if t else ''}" for lp, t in zip(r.naive_logprobs, r.naive_trained))
        gun = "SMOKING GUN" if r.smoking_guns(threshold) else ""
        lines.append(f"{r.sequence:>4} {r.op:<7} {f'{r.tito[0]}-{r.tito[1]}':>11} {f'{r.naive[0]}-{r.naive[1]}':>11} "
                     f"{_text(tokenizer, r.tito_ids, 26):<26} {_text(tokenizer, r.naive_ids, 26):<26} "
                     f"{lps[:28]:<28} {gun}")
    if len(regions) > limit:
        lines.append(f"... {len(regions) - limit} more regions (--limit)")
    return lines


def format_summary(s: DetectorSummary, threshold: float) -> list[str]:
    return [
        f"trajectories: {s.sequences}",
        f"naive retokenization: {s.sequences_differing} trajectories differ, {s.regions} regions, "
        f"{s.naive_tokens_differing} tokens ({s.naive_trained_tokens_differing} of them trained on), "
        f"min logprob {s.min_naive_logprob:.2f}",
        f"naive retokenization: SMOKING GUNS (trained, logprob < {threshold:g}): {s.smoking_guns}",
        "TI/TO: trains on the sampled ids themselves, so no token differs and smoking guns are 0; "
        f"{s.tito_sampled_below_threshold} of {s.tito_sampled_tokens} sampled tokens have logprob < {threshold:g} "
        f"(tokens the policy really sampled)",
    ]


def read_rollouts(path: Path):
    """(trajectories, prompt messages, tools) from a trainer rollouts file (one JSON per line)."""
    from spirl.trajectory import Trajectory

    trajs, messages, tools = [], [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            trajs.append(Trajectory.from_json(rec["trajectory"]))
            messages.append(rec["messages"])
            tools = rec.get("tools", tools)
        except (json.JSONDecodeError, KeyError) as e:
            raise SystemExit(f"error: {path}:{n} is not a rollout record ({type(e).__name__}: {e}); "
                             "pass a file written by simple_rl.py --save-rollouts 1")
    if not trajs:
        raise SystemExit(f"error: {path} has no rollouts")
    return trajs, messages, tools or []


def main(argv=None) -> int:
    from spirl.config import OneLineParser

    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", required=True, type=Path, help="a rollouts/step_*.jsonl file written by the trainer")
    p.add_argument("--model", required=True,
                   help="checkpoint to score with (a directory or an HF repo id): the policy that sampled")
    p.add_argument("--threshold", type=float, default=SMOKING_GUN_LOGPROB, help="smoking-gun logprob threshold")
    p.add_argument("--limit", type=int, default=40, help="rows of the table to print")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    args = p.parse_args(argv)
    if not args.rollouts.is_file():
        p.error(f"--rollouts {args.rollouts}: no such file")
    from spirl.chat_format import ToolChatFormat
    from spirl.tokenizer import load_tokenizer
    from torchtitan_compat.loading import load_model

    import weights

    trajs, messages, tools = read_rollouts(args.rollouts)
    try:
        model_dir = weights.resolve_model_dir(args.model)
    except weights.WeightsError as e:
        p.error(f"--model: {e}")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(model_dir, device=device, dtype=dtype, backend="auto" if device.type == "cuda" else "reference")
    fmt = ToolChatFormat(load_tokenizer(model_dir), tools)
    summary, regions = detect(trajs, messages, fmt, model, device, args.threshold)
    print("\n".join(format_table(regions, fmt.tokenizer, args.threshold, args.limit)))
    print()
    print("\n".join(format_summary(summary, args.threshold)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
