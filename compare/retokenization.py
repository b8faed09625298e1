"""CLI of the smoking-gun detector (spirl/loops/retokenization.py): what naive retokenization would train on.

    python compare/retokenization.py --rollouts runs/RUN/rollouts/step_000001.jsonl --model DIR

Prints a table of every region where decode -> chat template -> encode changes the sampled ids,
with the naive tokens' logprobs, and a summary (smoking guns: trained tokens with logprob < -15).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from spirl.loops.retokenization import SMOKING_GUN_LOGPROB, DetectorSummary, DiffRegion, detect


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
    from spirl.numerics.trajectory import Trajectory

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
    from spirl.core.config import OneLineParser

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
    from spirl.core.chat_format import ToolChatFormat
    from spirl.core.preflight import load_checked_tokenizer, resolve_device, validate_model_dir
    from weights_vllm_compat import load_model

    import weights

    trajs, messages, tools = read_rollouts(args.rollouts)
    model_dir = weights.resolve_model_dir(args.model)
    validate_model_dir(model_dir)  # before anything reads it
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(model_dir, device=device, dtype=dtype, backend="auto" if device.type == "cuda" else "reference")
    fmt = ToolChatFormat(load_checked_tokenizer(model_dir), tools)
    summary, regions = detect(trajs, messages, fmt, model, device, args.threshold)
    print("\n".join(format_table(regions, fmt.tokenizer, args.threshold, args.limit)))
    print()
    print("\n".join(format_summary(summary, args.threshold)))
    return 0


if __name__ == "__main__":
    from spirl.core.errors import run_cli

    raise SystemExit(run_cli(main))
