"""Where a command's start-up time goes, cold (empty kernel caches) and warm (the same caches, filled).

    python compare/cold_start.py -- ./run_comparison.sh --model DIR "The capital of France is"
    python compare/cold_start.py --until "step 1 " -- python simple_rl.py --model DIR --max-steps 1

Runs the command `--runs` times (default 2) with TRITON_CACHE_DIR, VLLM_CACHE_ROOT and
TORCHINDUCTOR_CACHE_DIR pointing at one fresh folder: the first run compiles every Triton kernel
and (for plain vLLM) torch.compile graph, later runs find them on disk, as a researcher's second
run does. Every output line is stamped with the seconds since launch; the table gives, per run:

  * the milestones SPIRL and vLLM log (when the line appeared), and
  * the durations vLLM reports itself (weights, model loading, torch.compile, CUDA-graph capture,
    engine init), read from its log lines (vLLM 0.26.0's wording; a line that is not found is
    shown as "-", so a reworded upstream message shows up as a missing row, not a wrong number);
  * the count of Triton kernels vLLM's JIT monitor saw compile after its warm-up (inference-time
    compiles, which a decode step then waits for);
  * the total wall clock, or the time to the first line matching `--until` if given.

Cold minus warm is the JIT and compile cost that a kernel cache removes. The first run also reads
the weights from disk while later runs may find them in the OS page cache; the weights rows show
that difference separately. The command's output is kept in `--out` (one log per run).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DURATIONS = {  # row -> regex whose group 1 is the seconds vLLM 0.26.0 reports on that line
    "vLLM: loading weights": r"Loading weights took ([\d.]+) seconds",
    "vLLM: model loading (weights + setup)": r"Model loading took .*? and ([\d.]+) seconds",
    "vLLM: torch.compile": r"torch\.compile took ([\d.]+) s in total",
    "vLLM: CUDA-graph capture": r"Graph capturing finished in ([\d.]+) secs",
    "vLLM: init engine (profile, KV cache, warm-up, graphs)": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)",
    "SPIRL: vLLM engine start (VLLMEngine)": r"vLLM engine ready in ([\d.]+)s",
}
MILESTONES = {  # row -> regex; the row is the time since launch of the first line matching it
    "first vLLM log line (imports, preflight done)": r"^(INFO|WARNING|DEBUG) \d\d-\d\d ",
    "vLLM engine ready": r"vLLM engine ready in",
    "trainer model loaded": r"trainer kernel backend:",
    "first GRPO step line (simple_rl.py)": r"\bstep 1/\d+ ",
}
JIT_AFTER_WARMUP = r"Triton kernel JIT compilation"


def run_once(cmd: list[str], env: dict, log_path: Path, until: str | None) -> dict:
    """Run cmd, stamp each output line with seconds since launch; return what the table needs."""
    t0 = time.perf_counter()
    stamped: list[tuple[float, str]] = []
    with open(log_path, "w") as log, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                                       stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            t = time.perf_counter() - t0
            stamped.append((t, line.rstrip("\n")))
            log.write(f"{t:9.3f} {line}")
            log.flush()
        rc = proc.wait()
    total = time.perf_counter() - t0
    out = {"rc": rc, "total": total}
    for name, rx in DURATIONS.items():
        hits = [float(m.group(1)) for _, line in stamped if (m := re.search(rx, line))]
        out[name] = sum(hits) if hits else None
    for name, rx in MILESTONES.items():
        out[name] = next((t for t, line in stamped if re.search(rx, line)), None)
    out["Triton kernels compiled after vLLM's warm-up"] = sum(1 for _, l in stamped if JIT_AFTER_WARMUP in l)
    if until:
        out["until"] = next((t for t, line in stamped if re.search(until, line)), None)
    return out


def table(results: list[dict], until: str | None) -> str:
    names = ["total" if not until else "until"] + list(MILESTONES) + list(DURATIONS) + [
        "Triton kernels compiled after vLLM's warm-up"]
    heads = ["cold"] + [f"warm {i}" for i in range(1, len(results))]
    label = {"total": "total wall clock (s)", "until": f"time to first line matching {until!r} (s)"}
    rows = [f"| {'':58s} | " + " | ".join(f"{h:>8s}" for h in heads) + " |",
            "|" + "-" * 60 + "|" + "|".join("-" * 10 for _ in heads) + "|"]
    for n in names:
        if all(r.get(n) is None for r in results) and n in MILESTONES:
            continue
        cells = [("-" if r.get(n) is None else f"{r[n]:.0f}" if isinstance(r[n], int) else f"{r[n]:.1f}")
                 for r in results]
        rows.append(f"| {label.get(n, n):58s} | " + " | ".join(f"{c:>8s}" for c in cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: compare/cold_start.py [options] -- COMMAND ...  (the command comes after --)")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2, help="the first is cold, the rest warm")
    p.add_argument("--until", help="also time the first output line matching this regex")
    p.add_argument("--out", default="runs/cold_start", help="one log per run, each line time-stamped")
    args = p.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    if not cmd:
        raise SystemExit("error: no command after --")
    if args.runs < 1:
        raise SystemExit("error: --runs must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="spirl-cold-"))
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache / "triton"), "VLLM_CACHE_ROOT": str(cache / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "PYTHONUNBUFFERED": "1"}
    results = []
    for i in range(args.runs):
        kind = "cold" if i == 0 else "warm"
        print(f"== run {i + 1}/{args.runs} ({kind} kernel caches in {cache}): {' '.join(cmd)}", flush=True)
        r = run_once(cmd, env, out / f"run{i + 1}_{kind}.log", args.until)
        print(f"   exit {r['rc']}, {r['total']:.1f} s; log {out / f'run{i + 1}_{kind}.log'}", flush=True)
        results.append(r)
    print(table(results, args.until))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
