"""Where a rollout's wall time goes, step by step: each vLLM engine step's wall time and the host time of its
model call and its sampling, for this project's engine or plain vLLM, with an optional cProfile of one rollout.

    VLLM_BATCH_INVARIANT=1 python compare/rollout_steps.py --model DIR --cells 128x16,129x16 [--cprofile 129x16]
    VLLM_BATCH_INVARIANT=0 python compare/rollout_steps.py --engine plain --model DIR --cells 128x16,129x16

A cell is BATCHxPROMPT (random prompt ids, --new-tokens each, as compare/bench_rollout.py times them). Per cell:
the rollout's seconds (--repeats runs after one warm-up), a prefill alone (one new token), and for every run
the engine's steps: the first steps' wall times (the prefill, then the first decode steps), the median of the
rest, and the host time of `execute_model` (inputs prepared, the forward launched: a CUDA-graph replay, or every
kernel launched one by one when the step is above the largest graph) and of `sample_tokens` (the logits, the
sampler). With vLLM's asynchronous scheduling the host prepares step N + 1 while the GPU runs step N, so a step
whose host time exceeds its GPU time shows up here and not in compare/profile_decode.py's kernel time (H100,
2026-11-27: an 8B prefill of 2,064 tokens, one above the largest graph, took 67 ms of host time against 53 ms of
kernels).
The GPU time of each model call and each sampling (CUDA events around them on the main stream: the kernels plus
any wait for the host inside the call, an upper bound on the kernels) tells a step that waits for the GPU from one
that waits for the host; Python's garbage collections during a run are counted and timed (a collection stalls
the host, and with it the next step's launch). `--cprofile CELL` adds a cProfile of one rollout of that cell
(`--cprofile-new 1`: of its prefill alone). Prints one JSON line per cell (every run's summary), then the profiles.
`--report OURS PLAIN` reads two such outputs (one per engine, each engine alone in its process) and prints per cell
the ratio of their GPU time per rollout (an upper bound on the kernels' time) and of their wall time: a cell whose
wall ratio is the host's noise is judged on the first.
The engine's batch-invariant mode must be the one its name says (VLLM_BATCH_INVARIANT=1 for ours, 0 for plain):
the process is refused otherwise.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

from compare.rollout_sweep import GOAL, print_ratio_table


def parse_cells(text: str) -> list[tuple[int, int]]:
    """'128x16,129x16' -> [(128, 16), (129, 16)] (batch, prompt tokens)."""
    try:
        cells = [tuple(int(v) for v in c.split("x")) for c in text.split(",") if c]
    except ValueError:
        cells = []
    if not cells or any(len(c) != 2 or min(c) < 1 for c in cells):
        raise SystemExit(f"error: cells {text!r}: expected BATCHxPROMPT[,...] of positive integers, e.g. 128x16")
    return cells


def summarize(events: list[tuple]) -> dict:
    """One rollout's step log -> its summary. Events: ("sched", t, tokens), ("step" | "exec" | "sample" | "gc", t0,
    t1) in seconds, ("gpu_exec" | "gpu_sample", start, end) CUDA events (recorded; synchronized before this runs)."""
    def ms(kind: str) -> list[float]:
        if kind.startswith("gpu_"):
            return [e[1].elapsed_time(e[2]) for e in events if e[0] == kind]
        return [1e3 * (e[2] - e[1]) for e in events if e[0] == kind]

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    steps, execs, samples, gcs = ms("step"), ms("exec"), ms("sample"), ms("gc")
    rest = steps[4:]
    return {"steps": len(steps), "tokens_first": [e[2] for e in events if e[0] == "sched"][:3],
            "step_ms_first": [round(s, 2) for s in steps[:4]],
            "step_ms_median_rest": median(rest),
            "step_ms_sum": round(sum(steps), 1),
            "exec_ms_first": [round(s, 2) for s in execs[:2]],
            "exec_ms_median": median(execs), "sample_ms_median": median(samples),
            "gpu_exec_ms_median": median(ms("gpu_exec")[1:]), "gpu_sample_ms_median": median(ms("gpu_sample")[1:]),
            "gpu_ms_sum": round(sum(ms("gpu_exec")) + sum(ms("gpu_sample")), 2),
            "gc_collections": len(gcs), "gc_ms_sum": round(sum(gcs), 2)}


def read_cells(path: str) -> dict[tuple[int, int, int], dict]:
    """This tool's output (one JSON line per cell among vLLM's log lines) -> {(batch, prompt, new tokens): row}."""
    cells = {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "runs" in row:
                cells[(row["batch"], row["prompt"], row["new_tokens"])] = row
    if not cells:
        raise SystemExit(f"error: {path}: no cell rows (this tool's JSON lines, one per cell)")
    return cells


def compare_cells(ours: dict, plain: dict) -> list[dict]:
    """Per cell both engines ran: the ratio (ours / plain) of the median rollout wall time and of the median GPU
    time of a rollout (every model call's and sampling's CUDA-event time, summed: kernels plus the host waits
    inside those calls, so an upper bound on the kernels), the cells in (batch, prompt) order."""
    out = []
    for key in sorted(ours.keys() & plain.keys()):
        o, p = ours[key], plain[key]
        gpu = []
        for name, row in (("ours", o), ("plain", p)):
            sums = [r.get("gpu_ms_sum") for r in row["runs"]]
            if not sums or None in sums:
                raise SystemExit(f"error: cell {key[0]}x{key[1]} of {name} has no GPU time per rollout (gpu_ms_sum, "
                                 "written since 13ab750): run it again with this tool")
            gpu.append(statistics.median(sums))
        wall = [statistics.median(row["seconds_each"]) for row in (o, p)]
        out.append({"batch": key[0], "prompt": key[1], "new_tokens": key[2], "wall_s": wall, "gpu_ms": gpu,
                     "wall_ratio": round(wall[0] / wall[1], 3), "gpu_ratio": round(gpu[0] / gpu[1], 3)})
    return out


def report(ours_path: str, plain_path: str, limit: float = GOAL) -> int:
    """Print compare_cells' table; a cell above `limit` (the sweep's goal) is flagged."""
    rows = compare_cells(read_cells(ours_path), read_cells(plain_path))
    if not rows:
        raise SystemExit(f"error: {ours_path} and {plain_path} have no cell in common")
    print_ratio_table(
        rows, "gpu_ratio", f"{'batch':>6} {'prompt':>6} {'new':>5}  {'ours GPU ms':>11} {'plain GPU ms':>12} "
        f"{'GPU ratio':>9}  {'ours s':>7} {'plain s':>7} {'wall ratio':>10}",
        lambda r: f"{r['batch']:>6} {r['prompt']:>6} {r['new_tokens']:>5}  {r['gpu_ms'][0]:>11.1f} "
                  f"{r['gpu_ms'][1]:>12.1f} {r['gpu_ratio']:>8.3f}x  {r['wall_s'][0]:>7.3f} {r['wall_s'][1]:>7.3f} "
                  f"{r['wall_ratio']:>9.3f}x",
        "by GPU time", limit, f"; by wall time worst {max(r['wall_ratio'] for r in rows):.3f}x")
    return 0


def instrument(llm, log: list) -> None:
    """Record each engine step, its scheduled tokens, its model call's and sampling's host times and GPU times
    (CUDA events on the current stream, vLLM's main stream) and each garbage collection in `log` (vLLM 0.26's
    in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0, as both engines here run)."""
    import torch

    core = llm.llm_engine.engine_core.engine_core
    sched, ex = core.scheduler, core.model_executor
    schedule, step, execute, sample = sched.schedule, core.step_fn, ex.execute_model, ex.sample_tokens

    def timed(kind, fn, gpu=False):
        def run(*args, **kw):
            if gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            out = fn(*args, **kw)
            log.append((kind, t, time.perf_counter()))
            if gpu:
                end.record()
                log.append(("gpu_" + kind, start, end))
            return out
        return run

    gc_started: list[float] = []

    def collection(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[:] = [time.perf_counter()]
        elif gc_started:
            log.append(("gc", gc_started.pop(), time.perf_counter()))

    gc.callbacks.append(collection)

    def scheduled(*args, **kw):
        out = schedule(*args, **kw)
        log.append(("sched", time.perf_counter(), out.total_num_scheduled_tokens))
        return out

    sched.schedule = scheduled
    core.step_fn = timed("step", step)
    ex.execute_model, ex.sample_tokens = timed("exec", execute, gpu=True), timed("sample", sample, gpu=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--engine", default="ours", help="ours[:MODE][@SIZES] or plain (compare/bench_rollout.py's names)")
    p.add_argument("--cells", help="BATCHxPROMPT,... e.g. 128x16,129x16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="the engine's max_model_len (SPIRL's engine captures graphs above 512 tokens only up to it)")
    p.add_argument("--cprofile", default="", help="cells to profile one rollout of (cProfile), e.g. 129x16")
    p.add_argument("--cprofile-new", type=int, default=0,
                   help="new tokens of the profiled rollout (default --new-tokens)")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--report", nargs=2, metavar=("OURS", "PLAIN"),
                   help="compare two runs of this tool (its stdout saved, one per engine) cell by cell: GPU and wall "
                        "time ratios; no GPU needed")
    args = p.parse_args(argv)
    if args.report:
        return report(*args.report)
    if not (args.model and args.cells):
        p.error("--model and --cells are required (or --report OURS PLAIN)")
    cells, profiled = parse_cells(args.cells), parse_cells(args.cprofile) if args.cprofile else []

    import torch

    from compare.bench_rollout import build_llm, rollout_inputs

    t0 = time.perf_counter()
    llm = build_llm(args.engine, args.model, 0.85, args.max_model_len)
    print(json.dumps({"engine": args.engine, "start_s": round(time.perf_counter() - t0, 1)}), flush=True)
    log: list = []
    instrument(llm, log)
    g = torch.Generator().manual_seed(0)

    def run(batch: int, prompt: int, new: int, prof: cProfile.Profile | None = None) -> tuple[float, list]:
        prompts, params = rollout_inputs(batch, prompt, new, g)
        log.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        if prof:
            prof.enable()
        llm.generate(prompts, params, use_tqdm=False)
        if prof:
            prof.disable()
        dt = time.perf_counter() - t
        torch.cuda.synchronize()  # every recorded CUDA event complete before summarize reads it
        return dt, list(log)

    run(8, 64, 16)  # warm-up
    for batch, prompt in cells:
        run(batch, prompt, min(args.new_tokens, 16))  # this cell's prefill shapes compiled
        runs = [run(batch, prompt, args.new_tokens) for _ in range(args.repeats)]
        prefill = [run(batch, prompt, 1)[0] for _ in range(2)]
        print(json.dumps({"engine": args.engine, "batch": batch, "prompt": prompt, "new_tokens": args.new_tokens,
                          "seconds_each": [round(t, 4) for t, _ in runs], "prefill_s": [round(t, 4) for t in prefill],
                          "runs": [summarize(events) for _, events in runs]}), flush=True)
    for batch, prompt in profiled:
        new = args.cprofile_new or args.new_tokens
        run(batch, prompt, new)
        prof = cProfile.Profile()
        dt, events = run(batch, prompt, new, prof)
        print(f"\n== cProfile {args.engine} {batch}x{prompt}, {new} new tokens: {dt:.3f} s (profiled), "
              f"{json.dumps(summarize(events))}")
        for order in ("tottime", "cumtime"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(args.top)
            print("\n".join(line for line in out.getvalue().splitlines() if line.strip()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
