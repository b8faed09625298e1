"""Training curves of one run as a PNG: held-out eval, reward, KL and entropy, parity.

    python compare/plot_run.py runs/<run> [--out PNG]        (needs the `plot` extra: matplotlib)

Reads <run>/metrics.jsonl (one JSON object per line: "step" and scalars), or, where that file is
missing, the TensorBoard event files in <run> (same tag names). A resumed run may log a step
again: the last line of each step wins. Eval scalars (eval/accuracy, eval/pass@K) come on the
step-0 line (the baseline eval before the first step) and on the lines of every eval step; they
are logged as fractions and plotted as percent.

Writes one figure (default <run>/curve.png), panels stacked over a shared "GRPO step" axis:
  eval      eval/accuracy (greedy) and every eval/pass@K, with markers (evals are sparse)
  reward    reward_mean per step, and its trailing mean over 10 steps
  KL        kl_div to the reference model ("no reference model (kl_coef = 0)" without one)
  entropy   entropy, the mean token entropy of the sampled completions
  parity    parity/tokens_compared (bars) and parity/tokens_different (should be 0) per step
titled with the run's name and, from <run>/run_metadata.json where present, model and GPU.
Prints one summary line; on bad input (no such directory, no metrics) one error line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

Series = dict[str, list[tuple[int, float]]]

ACCURACY = "eval/accuracy"
PASS_AT = re.compile(r"^eval/pass@(\d+)$")
ROLLING_WINDOW = 10
NO_REFERENCE = "no reference model (kl_coef = 0)"


class RunError(Exception):
    """The run directory cannot be read: missing, or without metrics."""


# ---------------------------------------------------------------- loading


def _scalar(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _rows_from_jsonl(path: Path) -> dict[int, dict]:
    """step -> its last logged line; blank, cut-off or step-less lines are skipped."""
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        rows[step] = row  # a resumed run logs a step again: the later line replaces the earlier
    return rows


def _series_from_rows(rows: dict[int, dict]) -> Series:
    series: Series = {}
    for step in sorted(rows):
        for key, value in rows[step].items():
            v = _scalar(value)
            if key != "step" and v is not None:
                series.setdefault(key, []).append((step, v))
    return series


def _series_from_tensorboard(run_dir: Path) -> Series:
    """Scalars of the event files in run_dir; the last event of each (tag, step) wins."""
    if not any(run_dir.glob("events.out.tfevents.*")):
        return {}
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(run_dir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    series: Series = {}
    for tag in acc.Tags().get("scalars", []):
        last = {int(e.step): float(e.value) for e in acc.Scalars(tag)}
        series[tag] = sorted(last.items())
    return series


def load_run(run_dir: str | Path) -> Series:
    """key -> [(step, value)] sorted by step, one value per step; raises RunError on bad input."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunError(f"no such run directory: {run_dir}")
    jsonl = run_dir / "metrics.jsonl"
    if jsonl.is_file():
        series = _series_from_rows(_rows_from_jsonl(jsonl))
        source = str(jsonl)
    else:
        series = _series_from_tensorboard(run_dir)
        source = f"{run_dir} (no metrics.jsonl, no TensorBoard scalars)"
    if not series:
        raise RunError(f"no metrics in {source}")
    return series


def load_metadata(run_dir: str | Path) -> dict:
    """run_metadata.json as a dict; {} where it is missing or unreadable."""
    try:
        meta = json.loads((Path(run_dir) / "run_metadata.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


# ---------------------------------------------------------------- numbers


def as_percent(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Fractions (every value within 0..1) as percent; values already in percent unchanged."""
    finite = [v for _, v in points if math.isfinite(v)]
    if finite and all(0.0 <= v <= 1.0 for v in finite):
        return [(s, 100.0 * v) for s, v in points]
    return list(points)


def rolling_mean(values: list[float], window: int = ROLLING_WINDOW) -> list[float]:
    """Trailing mean over up to `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def pass_at_keys(series: Series) -> list[str]:
    """eval/pass@K keys present, by K."""
    keys = [k for k in series if PASS_AT.match(k)]
    return sorted(keys, key=lambda k: int(PASS_AT.match(k).group(1)))


def training_steps(series: Series) -> list[int]:
    """Steps that logged anything besides eval/* (the step-0 baseline eval is not a step)."""
    steps = {s for key, points in series.items() if not key.startswith("eval/") for s, _ in points}
    return sorted(steps)


def summary(series: Series) -> dict:
    """First eval accuracy and best of the last three (percent), training steps, parity totals.

    Keys: first_eval_accuracy, best_last3_eval_accuracy (None without evals), evals, steps (number
    of training steps logged), last_step, parity_tokens_compared, parity_tokens_different."""
    acc = [v for _, v in as_percent(series.get(ACCURACY, [])) if math.isfinite(v)]
    steps = training_steps(series)
    return {
        "first_eval_accuracy": acc[0] if acc else None,
        "best_last3_eval_accuracy": max(acc[-3:]) if acc else None,
        "evals": len(acc),
        "steps": len(steps),
        "last_step": steps[-1] if steps else None,
        "parity_tokens_compared": int(sum(v for _, v in series.get("parity/tokens_compared", []))),
        "parity_tokens_different": int(sum(v for _, v in series.get("parity/tokens_different", []))),
    }


def summary_line(name: str, s: dict) -> str:
    if s["evals"]:
        evals = (f"eval accuracy {s['first_eval_accuracy']:.1f}% first, "
                 f"{s['best_last3_eval_accuracy']:.1f}% best of last {min(3, s['evals'])} ({s['evals']} evals)")
    else:
        evals = "no evals"
    return (f"{name}: {s['steps']} steps (last {s['last_step']}), {evals}, "
            f"parity {s['parity_tokens_compared']} tokens compared, {s['parity_tokens_different']} different")


def figure_title(name: str, meta: dict) -> str:
    """Run name, plus model and GPU where run_metadata.json has them."""
    model = None
    for section in ("config", "args", "reference"):
        part = meta.get(section)
        if isinstance(part, dict) and part.get("model"):
            model = part["model"]
            break
    extras = [str(x) for x in (model, meta.get("gpu")) if x]
    return " | ".join([name, *extras])


# ---------------------------------------------------------------- plotting


def _xy(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [s for s, _ in points], [v for _, v in points]


def _missing(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")
    ax.set_yticks([])


def _eval_panel(ax, series: Series) -> None:
    keys = ([ACCURACY] if ACCURACY in series else []) + pass_at_keys(series)
    for key in keys:
        label = "accuracy (greedy)" if key == ACCURACY else key.removeprefix("eval/")
        ax.plot(*_xy(as_percent(series[key])), marker="o", markersize=4, label=label)
    ax.set_title("held-out eval")
    ax.set_ylabel("percent")
    if keys:
        ax.legend(loc="best", fontsize="small")
    else:
        _missing(ax, "no evals logged")


def _reward_panel(ax, series: Series) -> None:
    ax.set_title("training reward")
    ax.set_ylabel("reward_mean")
    points = series.get("reward_mean")
    if not points:
        _missing(ax, "no reward_mean logged")
        return
    steps, values = _xy(points)
    ax.plot(steps, values, linewidth=0.7, alpha=0.6, label="per step")
    ax.plot(steps, rolling_mean(values), linewidth=2.0, label=f"mean of last {ROLLING_WINDOW}")
    ax.legend(loc="best", fontsize="small")


def _line_panel(ax, series: Series, key: str, title: str, missing: str) -> None:
    ax.set_title(title)
    ax.set_ylabel(key)
    if series.get(key):
        ax.plot(*_xy(series[key]), linewidth=1.0)
    else:
        _missing(ax, missing)


def _parity_panel(ax, series: Series, s: dict) -> None:
    ax.set_title(f"parity: {s['parity_tokens_compared']} tokens compared, {s['parity_tokens_different']} different")
    compared, different = series.get("parity/tokens_compared"), series.get("parity/tokens_different")
    if not compared and not different:
        _missing(ax, "no parity check logged")
        return
    handles = []
    if compared:
        handles.append(ax.bar(*_xy(compared), width=0.8, color="tab:blue", alpha=0.6, label="tokens compared"))
    ax.set_ylabel("tokens compared")
    if different:  # own axis, so a few differing tokens are not lost under thousands compared
        twin = ax.twinx()
        steps, values = _xy(different)
        handles += twin.plot(steps, values, color="tab:red", marker=".", linewidth=1.5, label="tokens different")
        top = max(1.0, max(values) * 1.1)
        twin.set_ylim(-0.05 * top, top)  # a line at 0 stays visible above the axis
        twin.set_ylabel("tokens different (should be 0)", color="tab:red")
    ax.legend(handles=handles, loc="lower right", fontsize="small")


def plot(series: Series, title: str, out: Path) -> None:
    """The stacked panels of `series` as a PNG at `out` (Agg backend, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 14), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(5, 1, sharex=True)
    _eval_panel(axes[0], series)
    _reward_panel(axes[1], series)
    _line_panel(axes[2], series, "kl_div", "KL to the reference model", NO_REFERENCE)
    _line_panel(axes[3], series, "entropy", "mean token entropy", "no entropy logged")
    _parity_panel(axes[4], series, summary(series))
    for ax in axes:
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("GRPO step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def plot_runs(runs: dict[str, Series], title: str, out: Path) -> None:
    """Several runs on one figure (compare/learning_curve.py's variants): held-out eval accuracy,
    the trailing mean of the training reward, and each run's differing-token count (should be 0)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 10), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 1, sharex=True, height_ratios=[3, 2, 1])
    for label, series in runs.items():
        s = summary(series)
        if series.get(ACCURACY):
            axes[0].plot(*_xy(as_percent(series[ACCURACY])), marker="o", markersize=3, label=label)
        if series.get("reward_mean"):
            steps, values = _xy(series["reward_mean"])
            axes[1].plot(steps, rolling_mean(values), linewidth=1.5, label=label)
        axes[2].plot(*_xy(series.get("parity/tokens_different", [])), linewidth=1.0,
                     label=f"{label}: {s['parity_tokens_different']} of {s['parity_tokens_compared']}")
    axes[0].set_title("held-out eval accuracy (greedy)")
    axes[0].set_ylabel("percent")
    axes[1].set_title(f"training reward (mean of the last {ROLLING_WINDOW} steps)")
    axes[2].set_title("parity: sampled tokens whose trainer logprob differs from the engine's (should be 0)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("GRPO step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Plot one training run's curves as a PNG.")
    p.add_argument("run_dir", type=Path, help="the run directory, e.g. runs/<run>")
    p.add_argument("--out", type=Path, default=None, help="PNG to write (default <run>/curve.png)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        series = load_run(args.run_dir)
    except RunError as e:
        print(f"plot_run: error: {e}", file=sys.stderr)
        return 2
    name = args.run_dir.resolve().name
    out = args.out or args.run_dir / "curve.png"
    plot(series, figure_title(name, load_metadata(args.run_dir)), out)
    print(f"{summary_line(name, summary(series))} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
