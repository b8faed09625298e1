"""Rollout speed: this project's vLLM engine vs plain vLLM with CUDA graphs, same checkpoint and prompts.

    VLLM_BATCH_INVARIANT=1 python compare/bench_rollout.py --model DIR            # or --shape Qwen3-1.7B
    python compare/bench_rollout.py --shape Qwen3-1.7B --engines ours,ours:none,plain --json out.json
    python compare/bench_rollout.py --sweep --shape Qwen3-8B --results sweep.jsonl [--label before]
    python compare/bench_rollout.py --sweep --paired --shape Qwen3-8B --results sweep.jsonl  # engines side by side
    python compare/bench_rollout.py --sweep --plan --shape Qwen3-8B --results sweep.jsonl   # no GPU: what a call runs
    python compare/bench_rollout.py --plot --results a.jsonl --results b.jsonl --png sweep.png

Each engine runs in its own process (vLLM reads VLLM_BATCH_INVARIANT at import):
  ours        spirl.engines.vllm_engine.VLLMEngine as the trainer builds it (VLLM_BATCH_INVARIANT=1,
              its patches, its default CUDA-graph mode); `ours:MODE` picks another mode
              (none = eager, full, full_decode_only, piecewise), `ours@MAX` other capture
              sizes (`engine_options`: e.g. ours@1024; ours@vllm: vLLM's own), `ours+triton` every
              GEMM on the Triton kernel (SPIRL_GEMM_CUBLAS=0: spirl_kernels/gemm_cublas.py; the same bits).
              On a Qwen3-MoE it returns every token's experts, as training runs it (the trainer checks them);
              `ours-routes` is the same engine without them, to show what returning them costs
  plain       vllm.LLM with VLLM_BATCH_INVARIANT=0 and vLLM's defaults (torch.compile + CUDA graphs):
              what a user would run instead
Every engine gets the same --gpu-memory-utilization and generates exactly the case's new tokens per
prompt (min_tokens = max_tokens, ignore_eos), T = 1.0, logprobs=0 (an RL trainer needs the sampled
tokens' logprobs either way), one completion per prompt, prompts of random token ids drawn afresh for
every run (the same ones for every engine; plain vLLM's prefix cache never serves a prefill). Each case
is run once untimed (its prefill shapes JIT-compiled), then timed --repeats times; the median is used
and the spread column shows the run-to-run noise (at batch 1 the host's speed shows:
the rollout profile of 2026-11-25: git show 6396e11:docs/rollout-profile.md, third run). Prints generated tokens/s per case, the engine start time, and
each engine's slowdown relative to `plain` (plain tokens/s / engine tokens/s).

--sweep (issue 39) runs a grid of decode batch sizes x prompt lengths (compare/rollout_sweep.py):
each engine is built once, then runs every cell the plan fits into --budget-s; each result is
appended to --results as one JSON line the moment it is measured, so a call cut short keeps what it
measured and the same command resumes from there (cells measured by every engine in one call are
skipped; each engine's share of the budget is its start estimate and 1/len(engines) of the rest). By
default the engines run one after the other; with --paired they are all built on the GPU at once (1/N of
the memory each) and each cell's runs alternate between them, the idle engines' processes stopped, so that
a shared host's slow minutes fall on every engine alike (at Qwen3-1.7B one engine's decode step moved
3.5 -> 6.0 ms between two runs minutes apart). Measured at Qwen3-8B (H100, 2026-11-27), a paired engine's runs still spread more than one run alone
(SPIRL's 1.2-7.3 % within a cell against 0.9-2.4 %; `ServedEngine`). At the end, and with --plot,
the report lists the worst cells and every cell above --goal, and --png draws the heatmap (matplotlib).

A Qwen3-MoE checkpoint (issue 64): the plan counts its experts (a decode step reads the experts its batch routes
to; `rollout_sweep.ModelSize`) and the GPU's own memory (nvidia-smi). Qwen3-30B-A3B's 56 GiB of bf16 weights fit
one engine at a time on an H200, so run it without --paired: each engine's process then has all of
--gpu-memory-utilization and exits before the next starts (--paired is refused where 1/N of it leaves no KV
cache). A cell's row records whether the engine returned routes (`routes`) and, where it did, how many experts
a decode step's tokens routed to (`decode_experts`, the mean over steps and layers); the engine row records the
tuned fused-MoE config file plain vLLM read (`moe_tuned_config`), and, as every engine row, the commit and command.
Write the checkpoint first with `weights.py --random Qwen3-30B-A3B --random-device cuda --out DIR` (74-82 s,
docs/moe.md; --shape would draw its 30B weights on the CPU) and pass --model DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from compare import rollout_sweep as sw

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (a worker's PYTHONPATH)."""

GRACE_S = 45.0
"""How long past its deadline a sweep worker may run (finishing a cell whose estimate was too low) before
it is killed; the cell in flight is then recorded as failed."""


TRITON_ONLY = "+triton"
"""Engine-name suffix: the engine's GEMMs all on spirl_kernels.gemm's Triton kernels (SPIRL_GEMM_CUBLAS=0), not on cuBLAS
where spirl_kernels.gemm_cublas finds it gives their bits."""

NO_ROUTES = "-routes"
"""Engine-name suffix (before +triton): a Qwen3-MoE engine that does not return its tokens' experts (vLLM's
enable_return_routed_experts off; the trainer needs them, so training never runs it). Against `ours` it shows what
returning the routes costs: their copy from the GPU every step, the scheduler's per-slot store, the per-request
arrays. The same engine as `ours` on a dense model."""


def engine_base(engine_name: str) -> str:
    """The engine name without its +triton and -routes suffixes."""
    return engine_name.removesuffix(TRITON_ONLY).removesuffix(NO_ROUTES)


def returns_routes(engine_name: str) -> bool:
    """Whether an engine asks vLLM for a MoE's routes: SPIRL's engines as the trainer runs them, not `-routes` or
    plain vLLM."""
    return engine_name != sw.REFERENCE and not engine_name.removesuffix(TRITON_ONLY).endswith(NO_ROUTES)


def engine_options(engine_name: str) -> dict:
    """VLLMEngineConfig fields of an `ours[:MODE][@SIZES]` engine name: MODE a CUDA-graph mode (default: the
    config's), SIZES `vllm` (vLLM's own capture sizes) or a number MAX (`vllm_engine.graph_sizes(MAX)`:
    vLLM's list to 512, then every 256 to MAX); without @, the config's default sizes."""
    from spirl.engines.vllm_engine import CUDA_GRAPH_MODES, VLLMEngineConfig, graph_sizes

    base, at, sizes = engine_base(engine_name).partition("@")
    head, _, mode = base.partition(":")
    mode = mode or VLLMEngineConfig.cuda_graphs
    bad_sizes = at and sizes != "vllm" and not (sizes.isdigit() and int(sizes))
    if head != "ours" or mode not in CUDA_GRAPH_MODES or bad_sizes:
        raise SystemExit(f"error: engine {engine_name!r}: use plain or ours[:MODE][@vllm|@MAX_TOKENS][{NO_ROUTES}]"
                         f"[{TRITON_ONLY}] "
                         f"with MODE one of {', '.join(CUDA_GRAPH_MODES)} (e.g. ours:full@2048)")
    opts = {"cuda_graphs": mode}
    if at:
        opts["cuda_graph_sizes"] = None if sizes == "vllm" else graph_sizes(int(sizes))
    return opts


def build_llm(engine_name: str, model: str, gpu_memory_utilization: float, max_model_len: int):
    """The vllm.LLM of an engine name: `plain` (vLLM's defaults; the process must have
    VLLM_BATCH_INVARIANT=0), or `ours[:MODE][@SIZES]` (the trainer's VLLMEngine: `engine_options`). Refuses a
    process whose VLLM_BATCH_INVARIANT is not the engine's (vLLM reads it at import: the engine would not be the
    one named, e.g. plain vLLM with batch-invariant kernels)."""
    want = worker_env(engine_name)["VLLM_BATCH_INVARIANT"]
    if (os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1") != (want == "1"):
        raise SystemExit(f"error: engine {engine_name!r} needs VLLM_BATCH_INVARIANT={want} in this process "
                         f"(it is {os.environ.get('VLLM_BATCH_INVARIANT', 'unset')}); run it with "
                         f"VLLM_BATCH_INVARIANT={want}")
    if engine_name == "plain":
        from vllm import LLM

        return LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                   gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len)
    from spirl.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    cfg = VLLMEngineConfig(model, seed=0, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                           **engine_options(engine_name))
    if returns_routes(engine_name):
        return VLLMEngine(cfg).llm
    return without_routes(lambda: VLLMEngine(cfg)).llm


def without_routes(build):
    """build(), with every vllm.LLM it makes built without enable_return_routed_experts: the `-routes` engine is
    VLLMEngine as training builds it less that one setting (VLLMEngine sets it for every MoE)."""
    import vllm

    real = vllm.LLM

    def llm(*args, **kwargs):
        kwargs.pop("enable_return_routed_experts", None)
        return real(*args, **kwargs)

    vllm.LLM = llm
    try:
        return build()
    finally:
        vllm.LLM = real


# -- the worker (one engine, in its own process, on the GPU host) ---------------------------------------


def rollout_inputs(batch: int, prompt_len: int, new: int, generator, seed: int = 1) -> tuple[list, object]:
    """The rollout the benchmarks time (this file, compare/profile_decode.py, compare/rollout_steps.py): `batch`
    prompts of `prompt_len` random ids drawn from `generator` (a torch.Generator), and vLLM SamplingParams that
    generate exactly `new` tokens each (min = max, EOS ignored) at T = 1 with the sampled tokens' logprobs (an RL
    trainer needs them either way), sampling seed `seed`. The ids are ordinary BPE tokens (below the first special
    token), so no prompt holds a control token."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from torchtitan_compat.tokenizer import NUM_BPE_TOKENS

    prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, NUM_BPE_TOKENS, (prompt_len,), generator=generator)
                            .tolist()) for _ in range(batch)]
    return prompts, SamplingParams(n=1, max_tokens=new, min_tokens=new, ignore_eos=True, temperature=1.0, logprobs=0,
                                   seed=seed)


def prompt_seed(cell: sw.Cell, role: str, repeat: int) -> int:
    """The prompts' seed of one run of a cell: the same in every engine's process, different for every
    (cell, role, repeat), so no prompt is ever seen twice by one engine (plain's prefix cache)."""
    return int.from_bytes(hashlib.sha256(f"{cell}:{role}:{repeat}".encode()).digest()[:7], "little")


def counted_run(run, builds, cell: sw.Cell, new: int, role: str, repeat: int) -> tuple[float, int | None]:
    """One run of a cell with `new` new tokens on the prompts of (cell, role, repeat) (`prompt_seed`): its seconds,
    and the Triton kernels built meanwhile (None where `builds()` cannot tell)."""
    before = builds()
    dt = run(cell.batch, cell.prompt_len, new, prompt_seed(cell, role, repeat))
    after = builds()
    return dt, (after - before if before is not None and after is not None else None)


def cell_row(cell: sw.Cell, warm: tuple, timed: list[tuple], prefill: list[tuple] | None) -> dict:
    """A cell's result row from its (seconds, builds) runs: the warm-up, the timed rollouts, the prefills (or None)."""
    times = [t for t, _ in timed]
    dt = statistics.median(times)
    row = {"batch": cell.batch, "prompt_len": cell.prompt_len, "new_tokens": cell.new_tokens,
           "seconds": round(dt, 4), "seconds_each": [round(t, 4) for t in times],
           "tokens_per_s": round(cell.batch * cell.new_tokens / dt, 1), "warm_seconds": round(warm[0], 4),
           "warm_triton_builds": warm[1],
           "timed_triton_builds": None if any(b is None for _, b in timed) else sum(b for _, b in timed)}
    if prefill is not None:
        each = [t for t, _ in prefill]
        row.update(prefill_seconds=round(statistics.median(each), 4), prefill_each=[round(t, 4) for t in each])
    return row


def time_cell(run, cell: sw.Cell, repeats: int, split_prefill: bool, builds) -> dict:
    """A cell's timings: one untimed warm-up of min(G, WARMUP_NEW_TOKENS) new tokens, then `repeats`
    rollouts (and, with `split_prefill`, `repeats` runs of one new token: the prefill). `run(batch,
    prompt_len, new_tokens, seed)` -> seconds; `builds()` -> Triton kernels built so far (or None),
    counted per phase: the warm-up's are the cell's first-run JIT cost, a timed run's taint its timing."""
    def counted(new: int, role: str, r: int) -> tuple[float, int | None]:
        return counted_run(run, builds, cell, new, role, r)

    warm = counted(min(cell.new_tokens, sw.WARMUP_NEW_TOKENS), "warm", 0)
    timed = [counted(cell.new_tokens, "rollout", r) for r in range(repeats)]
    prefill = [counted(1, "prefill", r) for r in range(repeats)] if split_prefill else None
    return cell_row(cell, warm, timed, prefill)


def paired_cell(counters: dict, cell: sw.Cell, repeats: int, split_prefill: bool) -> dict[str, dict]:
    """Every engine's row for one cell (`--paired`), their runs interleaved: each engine's warm-up, then per repeat
    one rollout of each engine, the order rotated every repeat (A B C, B C A, C A B, ...) so that no engine always
    follows the same one; then the prefills (`split_prefill`) likewise. `counters[name](new, role, repeat)` ->
    (seconds, builds), as `counted_run`."""
    names = list(counters)

    def interleaved(new: int, role: str) -> dict[str, list]:
        got = {n: [] for n in names}
        for r in range(repeats):
            k = r % len(names)
            for n in names[k:] + names[:k]:
                got[n].append(counters[n](new, role, r))
        return got

    warm = {n: counters[n](min(cell.new_tokens, sw.WARMUP_NEW_TOKENS), "warm", 0) for n in names}
    timed = interleaved(cell.new_tokens, "rollout")
    prefill = interleaved(1, "prefill") if split_prefill else None
    return {n: cell_row(cell, warm[n], timed[n], prefill[n] if prefill else None) for n in names}


def _attr(obj, path: str):
    """obj.a.b.c, or None where any part is missing (vLLM's config layout is not a stable API)."""
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def engine_facts(llm) -> dict:
    """What the sweep records of a built engine: the decode batch sizes it captured CUDA graphs for, its
    scheduler limits and KV-cache capacity in tokens (vLLM 0.26's config objects; None where absent)."""
    cfg = _attr(llm, "llm_engine.vllm_config")
    sizes = _attr(cfg, "compilation_config.cudagraph_capture_sizes")
    kv = _attr(cfg, "cache_config.kv_cache_size_tokens")
    blocks, block = _attr(cfg, "cache_config.num_gpu_blocks"), _attr(cfg, "cache_config.block_size")
    if kv is None and blocks and block:
        kv = blocks * block
    return {"capture_sizes": sorted(int(s) for s in sizes) if sizes else [],
            "cudagraph_mode": str(_attr(cfg, "compilation_config.cudagraph_mode")),
            "max_num_seqs": _attr(cfg, "scheduler_config.max_num_seqs"),
            "max_num_batched_tokens": _attr(cfg, "scheduler_config.max_num_batched_tokens"),
            "kv_tokens": int(kv) if kv else None, "kv_block": int(block) if block else None,
            "returns_routes": _attr(cfg, "model_config.enable_return_routed_experts"),
            "async_scheduling": _attr(cfg, "scheduler_config.async_scheduling"),
            "v2_model_runner": _attr(cfg, "use_v2_model_runner")}


def moe_tuned_config(size: sw.ModelSize) -> str | None:
    """The file of vLLM's tuned fused-MoE kernel configs that this process's engine reads for the model's experts
    (e.g. `E=128,N=768,device_name=NVIDIA_H200.json`: plain vLLM's, per token count); None for a dense model, in
    batch-invariant mode (vLLM's one fixed config, SPIRL's engine) or where vLLM has no file for this GPU (its
    default configs; it logs a warning). `?` and the error where vLLM 0.26's functions are not there."""
    if not size.sparse_layers:
        return None
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import get_config_file_name, get_moe_configs

        found = get_moe_configs(size.experts, size.moe_intermediate, None)  # bf16: no dtype in the file's name
        return get_config_file_name(size.experts, size.moe_intermediate, None) if found else None
    except Exception as e:  # noqa: BLE001 - a fact for the record, never a reason to stop the sweep
        return f"? ({type(e).__name__}: {e})"


def decode_experts(routes: list, prompt_len: int) -> float | None:
    """How many experts a decode step reads: over the decode steps and layers of one rollout, the mean number of
    distinct experts that the batch's tokens of that step route to (top-k each; 1 to E). `routes`: each sequence's
    routed experts as vLLM returns them ([prompt + new - 1, layers, k]); the rows from `prompt_len` on are the
    tokens fed to the decode steps. None when there is no decode step. What a decode step reads depends on it, and
    random weights need not route as a trained model does: recorded so that a cell's time can be read with it."""
    import numpy as np

    rows = [np.asarray(r)[prompt_len:] for r in routes]
    n = min((len(r) for r in rows), default=0)
    if n == 0:
        return None
    a = np.stack([r[:n] for r in rows]).astype(np.int64)  # [B, steps, layers, k]
    _, steps, layers, _ = a.shape
    seen = np.zeros((steps, layers, int(a.max()) + 1), dtype=bool)
    seen[np.arange(steps)[None, :, None, None], np.arange(layers)[None, None, :, None], a] = True
    return round(float(seen.sum(-1).mean()), 2)


def route_facts(outs, prompt_len: int, want: bool | None) -> dict:
    """A rollout's routes: {"routes": whether every completion carried its experts} and, where they did and the
    rollout decoded, {"decode_experts": `decode_experts`}. `want`: True (SPIRL's engine on a MoE, as training runs
    it), False (plain vLLM, `-routes`) or None (a dense model: none either way); raises if the engine did otherwise,
    so a row is never timed on an engine other than the one named."""
    routes = [getattr(c, "routed_experts", None) for o in outs for c in o.outputs]
    have = bool(routes) and all(r is not None for r in routes)
    if want is not None and have != want or want is None and have:
        raise RuntimeError(f"the engine returned {'routes' if have else 'no routes'}; expected "
                           f"{'routes (SPIRL engine on a MoE)' if want else 'none'}")
    if not have:
        return {"routes": False}
    return {"routes": True, "decode_experts": decode_experts(routes, prompt_len)}


def worker(args) -> None:
    """Build one engine, time every case (or, with --sweep, every cell its deadline allows), print one
    JSON line per result."""
    import torch

    cells = [sw.Cell(b, p, g) for b, p, g in parse_cases(args)]
    if args.sweep and args.deadline is None and not args.serve:
        raise SystemExit("error: a --sweep worker needs --deadline (the parent passes it)")
    size = sw.ModelSize.from_config(json.loads((Path(args.model) / "config.json").read_text()))
    want_routes = returns_routes(args.worker) if size.sparse_layers else None
    routes: dict = {}
    """The route facts of the last rollout that decoded (`route_facts`), added to the cell's row."""
    t0 = time.perf_counter()
    llm = build_llm(args.worker, args.model, args.gpu_memory_utilization, args.max_model_len)
    start = time.perf_counter() - t0
    from spirl.loops.precompile import TritonBuilds

    with TritonBuilds() as counter:  # after the engine: vLLM chains its JIT monitor in its warm-up
        builds = (lambda: counter.count) if counter.available else (lambda: None)
        def run(batch: int, prompt_len: int, new: int, seed: int) -> float:
            prompts, params = rollout_inputs(batch, prompt_len, new, torch.Generator().manual_seed(seed))
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            got = sum(len(c.token_ids) for o in outs for c in o.outputs)
            if got != batch * new:
                raise RuntimeError(f"generated {got} tokens, expected {batch * new}")
            facts = route_facts(outs, prompt_len, want_routes)
            if new > 1 or not routes:
                routes.clear()
                routes.update(facts)
            return dt

        def emit(row: dict) -> None:
            if row.get("kind", "cell") == "cell":  # the facts of its last rollout that decoded
                row = {**row, **{k: v for k, v in routes.items() if k != "decode_experts" or row["new_tokens"] > 1}}
            print(json.dumps(row), flush=True)

        run(8, 64, 16, seed=10**6)  # warm-up: kernels compiled, graphs touched
        if not args.sweep:
            for cell in cells:
                emit({"engine": args.worker, **time_cell(run, cell, args.repeats, False, builds),
                      "engine_start_s": round(start, 1)})
            return
        facts = engine_facts(llm)
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
        # GPU memory in use once started: vLLM's share (weights + KV cache) plus what it keeps beyond it
        # (CUDA graphs' pool, its context), so two engines with the same share compare their graphs' memory
        from spirl_kernels import gemm_cublas

        emit({"kind": "engine", "engine_start_s": round(start, 1), "gpu": gpu,
              "gpu_used_gib": round((total - free) / 2**30, 2), "gemm_checked": gemm_cublas.checked(),
              "moe_tuned_config": moe_tuned_config(size), **facts})
        if args.serve:
            serve(run, builds, sys.stdin, emit)
            return
        sweep_cells(run, cells, facts, size, sw.Deadline(at=args.deadline), args.repeats, args.split_prefill, builds, emit)


def serve(run, builds, requests, emit) -> None:
    """A `--paired` worker's loop: one JSON request per line, {"batch", "prompt_len", "new_tokens"} (the cell) and
    {"new", "role", "repeat"} (`counted_run`'s), each answered by one row {"kind": "run", "seconds", "builds"};
    it ends with its input (the parent closes it)."""
    for line in requests:
        if line.strip():
            req = json.loads(line)
            dt, built = counted_run(run, builds, sw.Cell.of(req), int(req["new"]), str(req["role"]), int(req["repeat"]))
            emit({"kind": "run", "seconds": dt, "builds": built})


def sweep_cells(run, cells: list[sw.Cell], facts: dict, size: sw.ModelSize, deadline: sw.Deadline, repeats: int,
                split_prefill: bool, builds, emit, clock=time.time) -> None:
    """A sweep worker's loop: per cell, in order, `skip` if its sequences do not fit the engine's KV cache
    at once, `stop` if the deadline no longer allows its estimate, else `start`, the timings
    (time_cell) and its `cell` row; every row through emit(dict)."""
    for i, cell in enumerate(cells):
        if not sw.fits_kv(cell, facts.get("kv_tokens"), facts.get("kv_block") or sw.KV_BLOCK_TOKENS):
            emit({"kind": "skip", "reason": f"KV cache: {cell.batch} sequences of {cell.prompt_len + cell.new_tokens} "
                  f"tokens do not fit {facts.get('kv_tokens')} tokens at once", **cell_fields(cell)})
            continue
        estimate = sw.cell_seconds(size, sw.Rates(), cell, repeats, split_prefill)
        if not deadline.allows(clock(), estimate):
            emit({"kind": "stop", "reason": f"budget: {len(cells) - i} cells left, the next estimated at "
                  f"{deadline.scale * estimate:.0f} s"})
            return
        emit({"kind": "start", **cell_fields(cell)})
        t = clock()
        row = time_cell(run, cell, repeats, split_prefill, builds)
        deadline.record(clock() - t, estimate)
        emit({"kind": "cell", **row})


def cell_fields(cell: sw.Cell) -> dict:
    return {"batch": cell.batch, "prompt_len": cell.prompt_len, "new_tokens": cell.new_tokens}


# -- the parent: cases, or the sweep ---------------------------------------------------------------------


def parse_cases(args) -> list[tuple[int, int, int]]:
    """(batch, prompt tokens, new tokens) per case: --cases "BxPxG,..." or the product of
    --batches and --new-tokens at --prompt-len."""
    if args.cases:
        try:
            cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
        except ValueError:
            cases = []
        if not cases or any(len(c) != 3 or min(c) < 1 for c in cases):
            raise SystemExit(f"error: --cases {args.cases!r}: expected BATCHxPROMPTxNEW[,...] of positive integers, "
                             "e.g. 8x512x256")
        return cases
    return [(b, args.prompt_len, n) for n in map(int, args.new_tokens.split(","))
            for b in map(int, args.batches.split(","))]


def worker_env(name: str) -> dict:
    """A worker's environment; the repo root leads PYTHONPATH, so that the worker (this file run by path) imports
    this checkout's `compare` and `spirl`, installed or not."""
    env = {**os.environ, "VLLM_BATCH_INVARIANT": "0" if name == "plain" else "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if name.endswith(TRITON_ONLY):
        env["SPIRL_GEMM_CUBLAS"] = "0"
    return env


def worker_cmd(name: str, args, cases: str, extra: list[str] = ()) -> list[str]:
    return [sys.executable, __file__, "--worker", name, "--model", args.model, "--batches", args.batches,
            "--new-tokens", args.new_tokens, "--prompt-len", str(args.prompt_len), "--cases", cases,
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--max-model-len", str(args.max_model_len),
            "--repeats", str(args.repeats), *extra]


def json_rows(lines):
    """The JSON objects among a worker's stdout lines, as they come (other lines are vLLM's logs)."""
    for line in lines:
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def stream_rows(cmd: list[str], env: dict, on_row, timeout: float | None = None) -> tuple[int, str, bool]:
    """Run cmd, calling on_row(dict) for every stdout line that is a JSON object as it arrives (other lines
    are vLLM's logs). Kills the process after `timeout` seconds. Returns (exit status, the end of its
    stderr, whether it was killed)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        timer = threading.Timer(timeout, kill) if timeout is not None else None
        if timer:
            timer.start()
        try:
            for row in json_rows(proc.stdout):
                on_row(row)
            rc = proc.wait()
        finally:
            if timer:
                timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        return rc, err.read()[-3000:], killed.is_set()


def run_engine(name: str, args) -> list[dict]:
    rows: list[dict] = []
    cmd = worker_cmd(name, args, args.cases or "")
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    rc, err, _ = stream_rows(cmd, worker_env(name), rows.append)
    for r in rows:
        print(f"   {name:24s} batch {r['batch']:4d}  prompt {r['prompt_len']:5d}  new {r['new_tokens']:5d}  {r['tokens_per_s']:10.1f} tok/s", flush=True)
    if rc != 0:
        print(f"   {name} FAILED (exit {rc}):\n{err}", flush=True)
    return rows


def run_sweep_engine(name: str, args, cells: list[sw.Cell], deadline: float, on_row) -> tuple[int, str, bool]:
    """One engine's worker over `cells` with a deadline (time.time() seconds); its rows go to on_row.
    Killed GRACE_S after the deadline. Returns stream_rows' (exit status, stderr end, killed)."""
    extra = ["--sweep", "--deadline", f"{deadline:.1f}"] + (["--split-prefill"] if args.split_prefill else [])
    cmd = worker_cmd(name, args, ",".join(map(str, cells)), extra)
    print(f"== {name}: {len(cells)} cells, deadline in {deadline - time.time():.0f} s", flush=True)
    return stream_rows(cmd, worker_env(name), on_row, timeout=max(deadline - time.time(), 0.0) + GRACE_S)


class EngineFailed(RuntimeError):
    """A `ServedEngine` exited, or did not answer in time; the message ends with its stderr's last line."""


def _die_with_parent() -> None:
    """In a served worker, before it runs (Linux): SIGKILL it when the parent dies, so that a parent killed outright
    cannot leave a stopped engine holding the GPU's memory (a stopped process ignores every other signal)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: close() still ends the worker on every exit the parent lives through


class ServedEngine:
    """One `--paired` engine: its worker process (`serve`), started with `start`, asked for runs with `run`, ended with
    `close`. Its stdout is read by a thread into a queue (JSON rows only; vLLM logs to stderr, which goes to a
    temporary file whose end an `EngineFailed` quotes). Between its runs the process is stopped (SIGSTOP; SIGCONT for
    the next run), so that an idle engine's process takes nothing from the one being timed. Measured (H100, 2026-11-27,
    Qwen3-8B, the same six 16-token-prompt cells, three runs each): the spread of SPIRL's engine's runs within a cell
    was 0.7-15.7 % (mean 10.5) with the other engine's process left running and 1.2-7.3 % (mean 3.9) with it stopped;
    plain vLLM's 3.7-20.9 % (9.5) and 3.1-13.5 % (7.7); one engine after the other (no --paired; five such cells)
    0.9-2.4 % and 4.3-10.8 %."""

    def __init__(self, name: str, cmd: list[str], env: dict):
        self.name = name
        self._err = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                      text=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._rows: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for row in json_rows(self._proc.stdout):
            self._rows.put(row)
        self._rows.put(None)  # end of output: the process is gone

    def _next(self, kind: str, timeout: float) -> dict:
        try:
            row = self._rows.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            raise EngineFailed(f"{self.name}: no {kind} row within {timeout:.0f} s") from None
        if row is None:
            self._proc.wait()
            last = (self.stderr_tail().strip().splitlines() or [""])[-1]
            raise EngineFailed(f"{self.name}: exit {self._proc.returncode}: {last}")
        if row.get("kind") != kind:
            raise EngineFailed(f"{self.name}: expected a {kind} row, got {row}")
        return row

    def _signal(self, sig: int) -> None:
        if self._proc.poll() is None:
            try:
                os.kill(self._proc.pid, sig)
            except ProcessLookupError:
                pass  # exited meanwhile: _next says why

    def start(self, timeout: float) -> dict:
        """The engine row, once the engine is built; the process is then stopped until its first run."""
        row = self._next("engine", timeout)
        self._signal(signal.SIGSTOP)
        return row

    def run(self, cell: sw.Cell, new: int, role: str, repeat: int, timeout: float) -> tuple[float, int | None]:
        """One run (`counted_run`) in the worker, continued for it and stopped again after: (seconds, builds)."""
        self._signal(signal.SIGCONT)
        try:
            self._proc.stdin.write(json.dumps({**cell_fields(cell), "new": new, "role": role, "repeat": repeat}) + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the process is gone: _next says why
        row = self._next("run", timeout)
        self._signal(signal.SIGSTOP)
        return row["seconds"], row["builds"]

    def stderr_tail(self, chars: int = 3000) -> str:
        self._err.seek(0)
        return self._err.read()[-chars:]

    def close(self) -> None:
        """End the worker (continued, its input closed, then killed after 30 s) and drop its stderr."""
        self._signal(signal.SIGCONT)
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._err.close()


def memory_share(args, n_engines: int) -> float:
    """Each engine's gpu_memory_utilization: all of --gpu-memory-utilization, or 1/n_engines of it with --paired
    (the engines share the GPU)."""
    return args.gpu_memory_utilization / n_engines if args.paired else args.gpu_memory_utilization


def paired_worker_cmd(name: str, args, n_engines: int) -> list[str]:
    """A `--paired` engine's worker command: the `serve` loop, with its `memory_share`."""
    share = argparse.Namespace(**vars(args))
    share.gpu_memory_utilization = memory_share(args, n_engines)
    return worker_cmd(name, share, "", ["--sweep", "--serve"])


def sweep_paired(args, engines: list[str], cells: list[sw.Cell], run_id: str, t_start: float,
                 size: sw.ModelSize, rates: sw.Rates) -> int:
    """`--sweep --paired`: every engine built on the GPU at once (one after another, so no two profile its memory
    together), then each cell run by all of them, interleaved (`paired_cell`), while the budget's estimate allows;
    rows appended to the first --results file as each cell completes. A failed engine ends the call (its cell is
    recorded as failed). Returns 1 on a failure."""
    deadline = sw.Deadline(at=t_start + args.budget_s)
    bases = {n: {"run_id": run_id, "label": args.label, "shape": shape_name(args), "engine": n, "model": args.model}
             for n in engines}
    served: dict[str, ServedEngine] = {}
    facts: dict[str, dict] = {}
    cell, failed = None, False
    print(f"== paired: {', '.join(engines)} at once, {memory_share(args, len(engines)):.3f} of the GPU's "
          f"memory each; {len(cells)} cells", flush=True)
    try:
        for name in engines:
            served[name] = ServedEngine(name, paired_worker_cmd(name, args, len(engines)), worker_env(name))
            facts[name] = served[name].start(deadline.at - time.time() + GRACE_S)
            sw.append_rows(args.results[0], [{**bases[name], **facts[name], **args.provenance}])
            print(f"   {name:12s} {progress_line(facts[name])}", flush=True)
        for cell in cells:
            if not all(sw.fits_kv(cell, f.get("kv_tokens"), f.get("kv_block") or sw.KV_BLOCK_TOKENS)
                       for f in facts.values()):
                reason = f"KV cache: {cell.batch} sequences of {cell.prompt_len + cell.new_tokens} tokens do not fit " \
                         f"one engine's share at once"
                sw.append_rows(args.results[0], [{**bases[n], "kind": "skip", "reason": reason, **cell_fields(cell)}
                                                 for n in engines])
                print(f"   skip {cell}: {reason}", flush=True)
                continue
            estimate = len(engines) * sw.cell_seconds(size, rates, cell, args.repeats, args.split_prefill)
            if not deadline.allows(time.time(), estimate):
                print(f"   stop: budget, the next cell ({cell}) estimated at {deadline.scale * estimate:.0f} s", flush=True)
                cell = None
                break
            t = time.time()
            limit = deadline.at - t + GRACE_S
            counters = {n: (lambda new, role, r, e=served[n], c=cell, lim=limit: e.run(c, new, role, r, lim))
                        for n in engines}
            rows = paired_cell(counters, cell, args.repeats, args.split_prefill)
            deadline.record(time.time() - t, estimate)
            sw.append_rows(args.results[0], [{**bases[n], "kind": "cell", "paired": True, **rows[n]} for n in engines])
            for n in engines:
                print(f"   {n:12s} {progress_line({'kind': 'cell', **rows[n]})}", flush=True)
        else:
            cell = None
    except EngineFailed as e:
        failed = True
        print(f"   FAILED: {e}", flush=True)
        for eng in served.values():
            tail = eng.stderr_tail()
            if tail.strip():
                print(f"--- {eng.name} stderr (end) ---\n{tail}", flush=True)
        if cell is not None:
            sw.append_rows(args.results[0], [{**bases[n], "kind": "fail", "reason": str(e), **cell_fields(cell)}
                                             for n in engines])
    finally:
        for eng in served.values():
            eng.close()
    report(args)
    return 1 if failed else 0


def provenance(argv: list[str]) -> dict:
    """What an engine row records of the call: the checkout's commit (`+` when its tracked files differ from it;
    None without git) and the command."""
    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, timeout=20,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "--short=12", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+"
    return {"commit": commit, "command": shlex.join(["python", "compare/bench_rollout.py", *argv])}


def check_memory(args, size: sw.ModelSize, rates: sw.Rates, n_engines: int) -> None:
    """Refuse, before anything starts, a sweep whose engines cannot hold the weights: with --paired every engine
    holds them in 1/N of the memory share (Qwen3-30B-A3B's 56 GiB of bf16 weights twice do not leave a KV cache
    on a 141 GB H200), and without it one engine holds them in all of it."""
    share = memory_share(args, n_engines)
    if sw.kv_tokens_estimate(size, rates, share) > 0:
        return
    need = (size.decode_weight_bytes + rates.reserved_bytes) / rates.gpu_bytes
    raise SystemExit(f"error: the weights ({size.decode_weight_bytes / 2**30:.1f} GiB) and vLLM's "
                     f"{rates.reserved_bytes / 2**30:.1f} GiB of activations leave no KV cache in "
                     f"{share:.3f} of {rates.gpu_bytes / 2**30:.1f} GiB"
                     + (": run without --paired (the engines one after the other, each with all of "
                        "--gpu-memory-utilization)" if args.paired else
                        f": raise --gpu-memory-utilization above {need:.2f}"))


def shape_name(args) -> str:
    """What the results call the model: --shape for a random checkpoint, else the directory's name."""
    return args.shape if args.model is None else Path(args.model).name


def model_size(args) -> sw.ModelSize:
    """The estimate's model: --model's config.json, else --shape's."""
    if args.model is not None:
        path = Path(args.model) / "config.json"
        if not path.is_file():
            raise SystemExit(f"error: --model {args.model}: no config.json there; pass a checkpoint directory "
                             "or leave --model out for a random --shape checkpoint")
        return sw.ModelSize.from_config(json.loads(path.read_text()))
    from torchtitan_compat.config import ConfigError, hf_config_for_shape

    try:
        return sw.ModelSize.from_config(hf_config_for_shape(args.shape))
    except ConfigError as e:
        raise SystemExit(f"error: --shape: {e}") from None


def sweep_grid(args) -> list[sw.Cell]:
    return sw.grid(sw.parse_batches(args.grid_batches), sw.parse_ints(args.grid_prompts, "--grid-prompts"),
                   args.grid_new_tokens)


def sweep(args, t_start: float) -> int:
    """The sweep: plan, one worker per engine (the first runs the planned cells, the others the cells it
    measured, so every cell of this call is measured by every engine on this machine), rows appended
    to the first --results file as they come, then the report."""
    engines = args.engines.split(",")
    if sw.REFERENCE not in engines or len(engines) < 2:
        raise SystemExit(f"error: --engines {args.engines!r}: --sweep compares engines with {sw.REFERENCE!r}; "
                         f"name it and at least one other, e.g. ours,{sw.REFERENCE}")
    engines = [e for e in engines if e != sw.REFERENCE] + [sw.REFERENCE]
    cells = sweep_grid(args)
    gpu = sw.gpu_memory_bytes()
    shape, size, rates = shape_name(args), model_size(args), sw.Rates(**({"gpu_bytes": gpu} if gpu else {}))
    check_memory(args, size, rates, len(engines))
    needed = max(c.prompt_len + c.new_tokens for c in cells)
    if args.max_model_len < needed:
        print(f"max_model_len {args.max_model_len} -> {needed} (the grid's longest prompt + new tokens)")
        args.max_model_len = needed
    done = sw.done_cells(sw.load_rows(args.results), args.label, shape, engines, args.retry_failed)
    todo = [c for c in cells if c not in done]
    writes = args.model is None and not (Path(args.cache_dir) / f"bench-{args.shape}" / "config.json").is_file()
    budget = args.budget_s - (time.time() - t_start)
    pl = sw.plan(todo, size, rates, budget, len(engines), args.repeats, args.split_prefill,
                 sw.kv_tokens_estimate(size, rates, memory_share(args, len(engines))), write_checkpoint=writes,
                 compiled=1)
    print(f"{shape}: grid {len(cells)} cells, {len(done)} done before, {len(todo)} to do; this call: {len(pl.cells)} "
          f"cells (estimate {pl.fixed_s:.0f} s of engine starts{' and checkpoint' if writes else ''} + "
          f"{pl.cells_s:.0f} s of cells, budget {budget:.0f} s); {len(pl.over_budget)} left for a later call; "
          f"{len(pl.no_kv)} do not fit the KV cache (estimate, {rates.gpu_bytes / 2**30:.1f} GiB of GPU memory"
          f"{'' if gpu else ': an H100 80GB assumed, nvidia-smi not found'})")
    if args.plan:
        for c in pl.cells:
            print(f"  {c}  {sw.cell_seconds(size, rates, c, args.repeats, args.split_prefill):7.1f} s per engine")
        return 0
    if not pl.cells:
        return report(args)
    ensure_model(args)
    run_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{socket.gethostname()}-{os.getpid()}"
    args.provenance = provenance(args.argv)
    if args.paired:
        return sweep_paired(args, engines, pl.cells, run_id, t_start, size, rates)
    failed = False
    measured: list[sw.Cell] = pl.cells
    for i, name in enumerate(engines):
        starts = [sw.engine_start_seconds(size, rates, compiled=e == sw.REFERENCE) for e in engines[i:]]
        deadline = sw.engine_deadline(time.time(), t_start + args.budget_s, starts)
        got, in_flight = [], []
        base = {"run_id": run_id, "label": args.label, "shape": shape, "engine": name, "model": args.model}

        def on_row(row: dict, base=base, got=got, in_flight=in_flight) -> None:
            kind = row.get("kind")
            if kind == "start":
                in_flight[:] = [sw.Cell.of(row)]
                return
            if kind in ("engine", "cell", "skip"):
                sw.append_rows(args.results[0], [{**base, **row, **(args.provenance if kind == "engine" else {})}])
            if kind == "cell":
                got.append(sw.Cell.of(row))
                in_flight.clear()
            print(f"   {name:12s} {progress_line(row)}", flush=True)

        rc, err, killed = run_sweep_engine(name, args, measured, deadline, on_row)
        if killed or rc != 0:
            failed = True
            last = (err.strip().splitlines() or [""])[-1]
            why = f"killed {GRACE_S:.0f} s after its deadline" if killed else f"exit {rc}: {last}"
            print(f"   {name} FAILED ({why}):\n{err}", flush=True)
            if in_flight:
                sw.append_rows(args.results[0], [{**base, "kind": "fail", "reason": why, **cell_fields(in_flight[0])}])
        measured = [c for c in measured if c in set(got)]
        if not measured:
            print(f"   no cell measured by {name}: the engines after it have nothing to compare", flush=True)
            break
    report(args)
    return 1 if failed else 0


def progress_line(row: dict) -> str:
    kind = row.get("kind")
    if kind == "cell":
        return (f"batch {row['batch']:4d}  prompt {row['prompt_len']:5d}  new {row['new_tokens']:4d}  "
                f"{row['seconds']:8.3f} s  {row['tokens_per_s']:10.1f} tok/s  spread {sw.spread(row)}")
    if kind == "engine":
        return (f"started in {row.get('engine_start_s')} s on {row.get('gpu')}: {len(row.get('capture_sizes') or [])} "
                f"capture sizes up to {max(row.get('capture_sizes') or [0])}, KV cache {row.get('kv_tokens')} tokens"
                + (f", {row['gpu_used_gib']} GiB of GPU memory in use" if row.get("gpu_used_gib") else ""))
    return f"{kind}: {row.get('reason', '')} {sw.Cell.of(row) if 'batch' in row else ''}".rstrip()


def report(args) -> int:
    """The worst cells and the misses of every engine against plain, per label and shape, from the
    --results files; and the heatmap when --png is given."""
    rows = sw.load_rows(args.results)
    if args.label is not None:
        rows = [r for r in rows if r.get("label", "") == args.label]
    engines = sorted({r["engine"] for r in rows if r["kind"] == "cell"} - {sw.REFERENCE})
    found = [p for e in engines for p in sw.pairs(rows, e)]
    if not found:
        print(f"no cell measured by {sw.REFERENCE} and another engine in one call in {', '.join(args.results)}")
        return 2 if args.plot else 0
    print("\n" + "\n".join(sw.report_lines(found, worst=args.worst, goal=args.goal)))
    for r in (r for r in rows if r["kind"] == "fail"):
        print(f"failed: {r['engine']} {r['shape']} {sw.Cell.of(r)}: {r.get('reason')} (--retry-failed runs it again)")
    skipped = {(r["shape"], str(sw.Cell.of(r))) for r in rows if r["kind"] == "skip"}
    if skipped:
        print(f"not run (KV cache too small for the batch at once): {', '.join(f'{s} {c}' for s, c in sorted(skipped))}")
    if args.png:
        try:
            out = sw.heatmap(found, args.png, goal=args.goal)
        except ImportError:
            print("matplotlib is not installed here: run --plot with the same --results where it is (the `plot` extra)")
        else:
            print(f"heatmap: {out}")
    return 0


def ensure_model(args) -> None:
    if args.model:
        return
    import torch

    import weights

    out = Path(args.cache_dir) / f"bench-{args.shape}"
    if not (out / "config.json").is_file():
        weights.write_random_checkpoint(out, args.shape, seed=0, dtype=torch.bfloat16, overwrite=True)
    args.model = str(out)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: a random --shape checkpoint)")
    p.add_argument("--shape", default="Qwen3-1.7B", help="weights.py shape for the random checkpoint")
    p.add_argument("--cache-dir", default="checkpoints/models")
    p.add_argument("--engines", default="ours,plain")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--new-tokens", default="256,1024")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--cases", help="BATCHxPROMPTxNEW,... (overrides --batches/--new-tokens/--prompt-len), "
                                   "e.g. 1x512x256,128x2048x64")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="the engines' max_model_len (--sweep raises it to the grid's longest prompt + new tokens)")
    p.add_argument("--repeats", type=int, default=None,
                   help="time each case this many times (fresh prompts each) and report the median; the table's "
                        "spread column is (slowest - fastest) / median, the run-to-run noise a ratio must beat "
                        "(default 1, with --sweep 2)")
    p.add_argument("--json")
    g = p.add_argument_group("sweep (issue 39)")
    g.add_argument("--sweep", action="store_true", help="run the grid --grid-batches x --grid-prompts")
    g.add_argument("--plan", action="store_true", help="with --sweep: print the cells this call would run and "
                                                       "their estimate, start nothing")
    g.add_argument("--plot", action="store_true", help="report (and --png) from --results alone, start nothing")
    g.add_argument("--grid-batches", default="default",
                   help="decode batch sizes: integers, ranges (1-512) and the words default (24 sizes, "
                        "rollout_sweep.DEFAULT_BATCHES), capture (vLLM 0.26's 51 capture sizes on an H100), "
                        "odd (one size past each capture size with a gap above it)")
    g.add_argument("--grid-prompts", default=",".join(map(str, sw.DEFAULT_PROMPTS)), help="prompt lengths")
    g.add_argument("--grid-new-tokens", type=int, default=sw.DEFAULT_NEW_TOKENS, help="new tokens per sequence")
    g.add_argument("--budget-s", type=float, default=540.0,
                   help="wall clock of the whole command (checkpoint, engine starts, cells); cells left over "
                        "are run by the same command again (default 540: a 10-minute job with a minute to spare)")
    g.add_argument("--results", action="append", default=[],
                   help="JSON-lines results file; new rows go to the first, all are read (resume, report); "
                        "repeat it to merge the files of several calls")
    g.add_argument("--label", default=None, help="tag for this sweep's rows, e.g. before / after (default '')")
    g.add_argument("--split-prefill", action="store_true",
                   help="also time each cell's prefill alone (one new token), for the decode-step ratio")
    g.add_argument("--retry-failed", action="store_true",
                   help="run cells again that crashed an engine or did not fit its KV cache before")
    g.add_argument("--png", help="write the heatmap here (needs matplotlib), e.g. sweep.png")
    g.add_argument("--worst", type=int, default=10, help="cells listed per shape besides every miss")
    g.add_argument("--goal", type=float, default=sw.GOAL, help="a cell above this time ratio is a miss")
    g.add_argument("--paired", action="store_true",
                   help="build every engine on the GPU at once, each with 1/N of --gpu-memory-utilization, and "
                        "interleave their runs of each cell (A B, B A, ...), the idle engines stopped, so a shared "
                        "host's slow spells hit every engine alike: each cell's ratio is a paired measurement")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.sweep else 1
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats {args.repeats}: must be 1 or more")
    if (args.sweep or args.plot) and not args.worker and not args.results:
        raise SystemExit("error: --sweep and --plot need --results FILE (JSON lines; an absent file starts a new sweep)")
    if args.sweep and args.plot:
        raise SystemExit("error: --sweep and --plot: pick one (--sweep reports at its end)")
    if args.sweep and not args.worker and (args.budget_s <= 0 or args.grid_new_tokens < 1):
        raise SystemExit(f"error: --budget-s {args.budget_s} and --grid-new-tokens {args.grid_new_tokens} must be positive")
    return args


def main(argv=None) -> int:
    t_start = time.time()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv
    if args.worker:
        worker(args)
        return 0
    if args.plot:
        return report(args)
    for name in args.engines.split(","):  # a bad engine name fails here, before any engine starts
        if name != "plain":
            engine_options(name)
    if args.sweep:
        args.label = args.label or ""
        return sweep(args, t_start)
    parse_cases(args)  # a bad --cases fails here, before any engine starts
    ensure_model(args)
    rows = [r for name in args.engines.split(",") for r in run_engine(name, args)]
    plain = {(r["batch"], r["prompt_len"], r["new_tokens"]): r["tokens_per_s"] for r in rows if r["engine"] == "plain"}
    print(f"\n{'engine':24s} {'batch':>5s} {'prompt':>6s} {'new':>5s} {'tok/s':>10s} {'plain tok/s':>12s} {'slowdown':>9s} "
          f"{'start s':>8s} {'spread':>7s}")
    for r in rows:
        ref = plain.get((r["batch"], r["prompt_len"], r["new_tokens"]))
        r["slowdown_vs_plain"] = round(ref / r["tokens_per_s"], 3) if ref else None
        print(f"{r['engine']:24s} {r['batch']:5d} {r['prompt_len']:6d} {r['new_tokens']:5d} {r['tokens_per_s']:10.1f} "
              f"{ref or float('nan'):12.1f} {r['slowdown_vs_plain'] or float('nan'):9.3f}x {r['engine_start_s']:8.1f} "
              f"{sw.spread(r):>7s}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
    failed = {r["engine"] for r in rows} != set(args.engines.split(","))
    return 1 if failed else 0


if __name__ == "__main__":
    from spirl.core.errors import run_cli

    sys.exit(run_cli(main, prog="bench_rollout.py"))
