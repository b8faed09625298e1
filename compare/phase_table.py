"""Where a GRPO step's time goes: the per-phase medians of one or more simple_rl.py runs, side by side.

    python compare/phase_table.py runs/<run>/metrics.jsonl [runs/<other>/metrics.jsonl ...] [--skip 1]

Reads the `time/<phase>` seconds and `memory/peak_gib/<phase>` that simple_rl.py logs every step
(spirl.loops.timing.phase_metrics), leaves out the first `--skip` steps (the first step pays for
inference-time kernel compiles), and prints one column per run: the median seconds of each phase,
its share of the step, the step's median, the largest peak memory of any phase, and the parity
totals over *all* steps (tokens compared and tokens different, summed; a skipped step's tokens are
checked too). A resumed run may log a step twice: the last line of each step wins.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def read_steps(path: Path) -> dict[int, dict]:
    """step -> scalars of metrics.jsonl (the last line of each step; step 0, the baseline eval, left out)."""
    steps: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {path}:{n} is not JSON ({e.msg}); pass simple_rl.py's metrics.jsonl") from None
        if row.get("step", 0) > 0:
            steps[row["step"]] = row
    return steps


def summarize(steps: dict[int, dict], skip: int) -> dict:
    """Median seconds per phase (steps after the first `skip`), peak GiB, parity totals over every step."""
    ids = sorted(steps)[skip:]
    timed = [steps[s] for s in ids]
    if not timed:
        raise SystemExit(f"error: {len(steps)} step(s) logged and --skip {skip}: nothing left to time")
    phases = sorted({k[5:] for row in timed for k in row if k.startswith("time/")})
    med = {p: statistics.median(row.get(f"time/{p}", 0.0) for row in timed) for p in phases}
    peaks = [v for row in steps.values() for k, v in row.items() if k.startswith("memory/peak_gib/")]
    return {"steps": ids, "median": med, "peak_gib": max(peaks, default=float("nan")),
            "compared": int(sum(r.get("parity/tokens_compared", 0) for r in steps.values())),
            "different": int(sum(r.get("parity/tokens_different", 0) for r in steps.values()))}


def table(names: list[str], sums: list[dict]) -> str:
    phases = [p for p in dict.fromkeys(p for s in sums for p in s["median"]) if p != "step"]
    w = max([12, *(len(n) for n in names)])
    pw = max([14, *(len(p) + 2 for p in phases)])
    lines = [f"{'phase':<{pw}}" + "".join(f"{n:>{w + 9}}" for n in names)]
    for p in [*phases, "step"]:
        cells = []
        for s in sums:
            v, step = s["median"].get(p), s["median"].get("step")
            share = f" ({100 * v / step:3.0f}%)" if v is not None and step and p != "step" else " " * 7
            cells.append(f"{'-' if v is None else f'{v:.2f} s':>{w + 2}}{share}")
        lines.append(f"{p:<{pw}}" + "".join(cells))
    lines.append(f"{'steps timed':<{pw}}" + "".join(f"{len(s['steps']):>{w + 2}}       " for s in sums))
    lines.append(f"{'peak GiB':<{pw}}" + "".join(f"{s['peak_gib']:>{w + 2}.1f}       " for s in sums))
    parity = [f"{s['different']}/{s['compared']} diff" for s in sums]
    lines.append(f"{'parity':<{pw}}" + "".join(f"{c:>{w + 2}}       " for c in parity))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs="+", type=Path, help="metrics.jsonl of a simple_rl.py run (or its run folder)")
    p.add_argument("--skip", type=int, default=1, help="leading steps left out of the medians (default 1)")
    a = p.parse_args(argv)
    paths = [m / "metrics.jsonl" if m.is_dir() else m for m in a.metrics]
    for m in paths:
        if not m.is_file():
            raise SystemExit(f"error: {m} does not exist; pass runs/<run>/metrics.jsonl of a simple_rl.py run")
    sums = [summarize(read_steps(m), a.skip) for m in paths]
    print(table([m.parent.name for m in paths], sums))
    return 0


if __name__ == "__main__":
    sys.exit(main())
