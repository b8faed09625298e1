"""Where a command's start-up time goes, cold (empty kernel caches) and warm (the same caches, filled).

    python compare/cold_start.py -- ./run_comparison.sh --model DIR "The capital of France is"
    python compare/cold_start.py --until "step 1 " -- python simple_rl.py --model DIR --max-steps 1
    python compare/cold_start.py --from-logs runs/cold_start     (the table again, from the kept logs)

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
MILESTONES = {  # row -> regex; the row is the time since launch of the first line matching it (in start-up order)
    "first vLLM log line (imports, preflight done)": r"^(INFO|WARNING|DEBUG) \d\d-\d\d ",
    "model class inspected (architecture resolved)": r"Resolved architecture:",
    "weights loaded": r"Model loading took",
    "profile run done (KV cache sized)": r"GPU KV cache size:",
    "CUDA graphs captured": r"Graph capturing finished",
    "vLLM warm-up done (JIT monitor on)": r"Kernel JIT monitor activated",
    "vLLM engine ready": r"vLLM engine ready in",
    "trainer model loaded": r"trainer kernel backend:",
    "first GRPO step line (simple_rl.py)": r"\bstep 1/\d+ ",
}
"""What happens between two milestones (vLLM 0.26.0, V2 model runner): before the first vLLM line,
Python imports (torch, vLLM, transformers) and SPIRL's preflight; to "model class inspected", vLLM's
registry inspects the architecture's class in a fresh Python subprocess unless
VLLM_CACHE_ROOT/modelinfos has it (a cold cost only); to "weights loaded", the safetensors read; to
"KV cache sized", the profile run (Triton JIT of each kernel at the largest batch, cold); then CUDA
graph capture; to "warm-up done", `warmup_kernels` runs a real step and the sampler to JIT-compile its
Triton kernels (cold). The stage table gives these differences per run."""
JIT_AFTER_WARMUP = r"Triton kernel JIT compilation"


def summarize(stamped: list[tuple[float, str]], rc: int, total: float, until: str | None) -> dict:
    """What the table needs, from a run's (seconds since launch, line) pairs."""
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
    return summarize(stamped, rc, time.perf_counter() - t0, until)


def read_log(path: Path, until: str | None) -> dict:
    """A run's table entry from the time-stamped log an earlier run_once wrote. The exit status is not in the
    log (taken as 0), and the total is the time of the last line, not of the process's exit."""
    stamped = []
    for line in path.read_text().splitlines():
        head, _, rest = line.lstrip().partition(" ")  # run_once wrote f"{t:9.3f} {line}"
        try:
            stamped.append((float(head), rest))
        except ValueError:
            raise SystemExit(f"error: {path} is not a cold_start.py log (a line does not start with seconds)") from None
    return summarize(stamped, 0, stamped[-1][0] if stamped else 0.0, until)


def stages(r: dict) -> list[tuple[str, float]]:
    """(stage, seconds) between consecutive milestones found in run r, from launch to the last one."""
    out, prev_t = [], 0.0
    for name in MILESTONES:
        t = r.get(name)
        if t is not None:
            out.append((f"stage: previous -> {name}", t - prev_t))
            prev_t = t
    return out


def table(results: list[dict], until: str | None) -> str:
    names = ["total" if not until else "until"] + list(MILESTONES) + list(DURATIONS) + [
        "Triton kernels compiled after vLLM's warm-up"]
    heads = ["cold"] + [f"warm {i}" for i in range(1, len(results))]
    label = {"total": "total wall clock (s)", "until": f"time to first line matching {until!r} (s)"}
    per_run = [dict(stages(r)) for r in results]
    width = max([58, *(len(k) for s in per_run for k in s)])
    rows = [f"| {'':{width}s} | " + " | ".join(f"{h:>8s}" for h in heads) + " |",
            "|" + "-" * (width + 2) + "|" + "|".join("-" * 10 for _ in heads) + "|"]

    def row(name: str, cells: list[str]) -> None:
        rows.append(f"| {name:{width}s} | " + " | ".join(f"{c:>8s}" for c in cells) + " |")
    for n in names:
        if all(r.get(n) is None for r in results) and n in MILESTONES:
            continue
        row(label.get(n, n), [("-" if r.get(n) is None else f"{r[n]:.0f}" if isinstance(r[n], int) else f"{r[n]:.1f}")
                              for r in results])
    for stage in dict.fromkeys(k for s in per_run for k in s):  # stages in order of first appearance
        row(stage, ["-" if stage not in s else f"{s[stage]:.1f}" for s in per_run])
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2, help="the first is cold, the rest warm")
    p.add_argument("--until", help="also time the first output line matching this regex")
    p.add_argument("--out", default="runs/cold_start", help="one log per run, each line time-stamped")
    p.add_argument("--from-logs", type=Path, help="no run: the table of the run*.log files an earlier run left here")
    args = p.parse_args(argv[:cut])
    if args.from_logs:
        logs = sorted(args.from_logs.glob("run*.log"), key=lambda f: int(re.match(r"run(\d+)", f.name).group(1)))
        if not logs:
            raise SystemExit(f"error: no run*.log in {args.from_logs}; pass the --out folder of an earlier run")
        print(table([read_log(f, args.until) for f in logs], args.until))
        return 0
    cmd = argv[cut + 1:]
    if not cmd:
        raise SystemExit("usage: compare/cold_start.py [options] -- COMMAND ...  (the command comes after --), "
                         "or compare/cold_start.py --from-logs DIR")
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
