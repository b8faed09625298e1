"""Asynchronous GRPO against the synchronous step: the same run with --off-policy-steps 0 and K, side by side.

    VLLM_BATCH_INVARIANT=1 python compare/offpolicy_bench.py --out /tmp/offp
    VLLM_BATCH_INVARIANT=1 python compare/offpolicy_bench.py --out /tmp/offp --model random:Qwen3-1.7B --k 1 \\
        --steps 6 --prompts-per-step 6 --group-size 8 --max-new-tokens 768 --repeat 1 -- --lr 1e-6

    VLLM_BATCH_INVARIANT=1 python compare/offpolicy_bench.py --out /tmp/offp --ranks 1,2 --split 1 --repeat 0  # 2 GPUs
    VLLM_BATCH_INVARIANT=1 python compare/offpolicy_bench.py --out /tmp/offp --model DIR --ranks 2 --split 2    # 4 GPUs
    VLLM_BATCH_INVARIANT=1 python compare/offpolicy_bench.py --out /tmp/offp --ranks 1 --split 1 --trl 1,2  # + TRL
    VLLM_BATCH_INVARIANT=1 python compare/offpolicy_bench.py --out /tmp/offp --split 1 --colocated 0 --partial 0,384 \
        --trl 2 --repeat 0   # the 1 + 1 run without and with partial rollouts of 384 tokens, and TRL on 2 GPUs
    VLLM_BATCH_INVARIANT=1 python compare/offpolicy_bench.py --out /tmp/offp --split 1 --colocated 0 --partial 0,384 \
        --trl 2 --trl-server 1 --repeat 0   # + TRL's server mode and AsyncGRPOTrainer on 1 + 1 GPUs

For each R of --ranks: simple_rl.py on R trainer ranks (R = 1: one process; else torchrun, FSDP2, each rank's engine
beside it) with --off-policy-steps 0, then K (for the first R, K once more with --repeat 1); and for each R of
--split, K with --generation-gpus R (each rank's engine on a GPU of its own: 2R GPUs). The same model, seed and
shape, no checkpoints but the last. Prints compare/phase_table.py's per-phase medians of steps 2.. side by side
(with K > 0, `rollout` is the engine's time beside the trainer and `rollout_wait` what the trainer waited for it),
each K run's throughput against the synchronous run on as many trainer ranks and against the first synchronous
run, parity totals, the offpolicy/* means, and whether the repeat and each split run equal their colocated K run
in every scalar but times and memory. For each G of --trl, TRL's GRPOTrainer (compare/trl_grpo.py, plain vLLM
colocated, `accelerate launch` on several GPUs) runs the same model, prompts and shape on G GPUs, and each SPIRL run on
G GPUs (R trainer ranks, or R + R with --generation-gpus) is printed against it; for each R of --trl-server, TRL
with a vLLM server on a GPU of its own (R trainer GPUs + 1, compare/trl_server.py): GRPOTrainer's server mode and
AsyncGRPOTrainer with max_staleness K (left out, said in one line, where it cannot run: it fetches FlashAttention-3
from the Hugging Face kernel hub), the layout SPIRL's 1 + 1 split is compared with. With --partial C1,C2 every SPIRL
run is made once per C with --partial-rollout-tokens C (names suffixed -pC; 0: without), and --colocated 0 leaves
out the colocated runs of the rank counts in --split. Exit status 1 if a run failed, a token differed or a run that
should equal another did not.
Arguments after `--` go to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compare.phase_table import read_steps, summarize, table

REPO = Path(__file__).resolve().parents[1]


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory of the runs' logs and checkpoints")
    p.add_argument("--model", default="random:Qwen3-1.7B")
    p.add_argument("--k", type=int, default=1, help="--off-policy-steps of the asynchronous runs")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts-per-step", type=int, default=6)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=768)
    p.add_argument("--repeat", type=int, default=1, help="1 = run K twice and compare every scalar")
    p.add_argument("--split", default="0",
                   help="comma-separated trainer rank counts R (of --ranks) whose K run is also made with "
                        "--generation-gpus R (engines on GPUs of their own, 2R GPUs); 0: none")
    p.add_argument("--ranks", default="1",
                   help="comma-separated trainer rank counts, each run as above (R > 1: torchrun)")
    p.add_argument("--skip", type=int, default=1, help="steps left out of the medians (compiles)")
    p.add_argument("--trl", default="0",
                   help="comma-separated GPU counts to run TRL's GRPOTrainer on, as the anchor; 0: none")
    p.add_argument("--trl-server", default="0",
                   help="comma-separated trainer GPU counts R: TRL's GRPOTrainer in server mode and AsyncGRPOTrainer "
                        "(max_staleness = --k) on R trainer GPUs with a vLLM server on one more (R + 1); 0: none")
    p.add_argument("--trl-args", default="", help="flags for every TRL run (compare/trl_grpo.py), e.g. --micro-batch 4")
    p.add_argument("--partial", default="0",
                   help="comma-separated --partial-rollout-tokens budgets C: every SPIRL run once per C (0: without)")
    p.add_argument("--colocated", type=int, choices=(0, 1), default=1,
                   help="0: leave out the colocated runs (synchronous and K) of the rank counts in --split")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then flags for every simple_rl.py run")
    a = p.parse_args(argv)
    a.rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    try:
        a.ranks = [int(r) for r in a.ranks.split(",")]
        a.split = [int(r) for r in a.split.split(",") if int(r)]
        a.trl = sorted({int(g) for g in a.trl.split(",") if int(g)})
        a.trl_server = sorted({int(g) for g in a.trl_server.split(",") if int(g)})
        a.partial = list(dict.fromkeys(int(c) for c in a.partial.split(",")))
    except ValueError:
        p.error("--ranks, --split, --trl, --trl-server and --partial take counts separated by commas, e.g. 1,2")
    if not a.ranks or min(a.ranks + a.trl + a.trl_server) < 1 or not set(a.split) <= set(a.ranks) or min(a.partial) < 0:
        p.error(f"--ranks {a.ranks}, --split {a.split}, --trl {a.trl}, --trl-server {a.trl_server}, --partial "
                f"{a.partial}: counts >= 1 "
                "(--partial's >= 0), and --split's among --ranks'")
    if not a.colocated and not a.split:
        p.error("--colocated 0 leaves only the --split runs: name at least one with --split R")
    return a


def run_one(a, name: str, k: int, ranks: int, *extra: str) -> Path:
    """simple_rl.py on `ranks` trainer ranks into <out>/runs/<name>; its metrics.jsonl."""
    out = Path(a.out)
    launch = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                  f"--nproc-per-node={ranks}"]
    cmd = [*launch, str(REPO / "simple_rl.py"), "--model", a.model, "--steps", str(a.steps),
           "--prompts-per-step", str(a.prompts_per_step), "--group-size", str(a.group_size),
           "--max-new-tokens", str(a.max_new_tokens), "--off-policy-steps", str(k), "--checkpoint-every", "0",
           "--out-dir", str(out / "runs"), "--checkpoint-dir", str(out / "ck"), "--run-name", name, *a.rest, *extra]
    print(f"$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ, cwd=REPO).returncode
    print(f"{name}: exit {rc} after {time.perf_counter() - start:.0f} s (log {out / f'{name}.log'})", flush=True)
    if rc:
        print((out / f"{name}.log").read_text()[-3000:], flush=True)
        raise SystemExit(1)
    shutil.rmtree(out / "ck" / name, ignore_errors=True)  # the last step's checkpoint: not needed, and large
    return out / "runs" / name / "metrics.jsonl"


def _deterministic(steps: dict[int, dict]) -> list[dict]:
    return [{k: v for k, v in steps[s].items() if not k.startswith(("time/", "memory/", "triton/"))}
            for s in sorted(steps)]


def _tag(ranks: int) -> str:
    """The run names' suffix for a rank count: none for one, `-xR` for R."""
    return "" if ranks == 1 else f"-x{ranks}"


def _runs(a) -> list[tuple[str, int, int, tuple[str, ...]]]:
    """(name, K, trainer ranks, extra flags) of every run, in order (names suffixed by _tag, then -pC)."""
    runs = []
    for c in a.partial:
        pc = ("--partial-rollout-tokens", str(c)) if c else ()
        suffix = f"-p{c}" if c else ""
        for i, r in enumerate(a.ranks):
            tag = _tag(r) + suffix
            if a.colocated or r not in a.split:
                runs += [(f"sync{tag}", 0, r, pc), (f"k{a.k}{tag}", a.k, r, pc)]
                if a.repeat and i == 0:
                    runs.append((f"k{a.k}-again{tag}", a.k, r, pc))
            if r in a.split:
                runs.append((f"k{a.k}-split{tag}", a.k, r, ("--generation-gpus", str(r), *pc)))
    return runs


def _gpus(ranks: int, extra: tuple[str, ...]) -> int:
    """The GPUs a run takes: its trainer ranks, and as many engine GPUs with --generation-gpus."""
    return 2 * ranks if "--generation-gpus" in extra else ranks


def run_trl(a) -> dict[str, tuple[int, float]]:
    """TRL's median step, by label: on each GPU count G of --trl GRPOTrainer with vLLM colocated ("G"), and for
    each R of --trl-server GRPOTrainer's server mode ("server-R+1") and AsyncGRPOTrainer ("async-R+1") with a
    vLLM server on GPU R (compare/trl_grpo.py, same model and shape). Values: (GPUs, seconds); an
    AsyncGRPOTrainer that failed or cannot run is left out (its line says why), any other failure exits."""
    from compare.trl_grpo import launch
    from spirl.core.preflight import resolve_model

    model = str(resolve_model(a.model, str(Path(a.out) / "ck")))  # the directory simple_rl.py wrote a random: to
    todo = [(str(g), g, g, "colocate") for g in a.trl]
    todo += [(f"{lay}-{r}+1", r, r + 1, lay) for r in a.trl_server for lay in ("server", "async")]
    times = {}
    for label, trainer_gpus, gpus, layout in todo:
        name = f"trl{_tag(gpus)}" if layout == "colocate" else f"trl-{label}"
        step, line = launch(model, trainer_gpus, Path(a.out) / name, prompts_per_step=a.prompts_per_step,
                            group_size=a.group_size, max_new_tokens=a.max_new_tokens, steps=a.steps, skip=a.skip,
                            extra=tuple(shlex.split(a.trl_args)), layout=layout, max_staleness=a.k)
        print(f"{name}: {line}", flush=True)
        if step is None and layout == "async":  # TRL's experimental trainer: the other anchors stand without it
            continue
        if step is None:
            raise SystemExit(1)
        times[label] = (gpus, step)
    return times


def _same(steps: dict, x: str, y: str) -> bool:
    return _deterministic(steps[x]) == _deterministic(steps[y])


def main(argv=None) -> int:
    a = _args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    runs = _runs(a)
    steps = {n: read_steps(run_one(a, n, k, r, *extra)) for n, k, r, extra in runs}
    names = [n for n, *_ in runs]
    sums = dict(zip(names, (summarize(steps[n], a.skip) for n in names)))
    print(table(names, list(sums.values())))
    step = {n: sums[n]["median"]["step"] for n in names}
    base = names[0]  # the synchronous run on the first rank count
    out, bad = {}, any(s["different"] for s in sums.values())
    for n, k, r, extra in runs:
        if k:
            sync = n.replace(f"k{a.k}", "sync", 1).replace("-again", "").replace("-split", "")
            where = f"{r} trainer rank(s)" + (f" + {r} engine GPU(s)" if "--generation-gpus" in extra else "")
            against = f"; against {sync}: x{step[sync] / step[n]:.2f} throughput" if sync in step else ""
            also = "" if base in (sync, n) else f"; against {base}: x{step[base] / step[n]:.2f}"
            print(f"{n} ({where}): step {step[n]:.3f} s{against}{also}")
            out[n] = step[n]
        if "-again" in n or "-split" in n:
            twin = n.replace("-again", "").replace("-split", "")
            if twin not in steps:
                continue
            same = _same(steps, twin, n)
            print(f"{n}: {'identical to' if same else 'DIFFERENT from'} {twin} in every scalar but times")
            bad = bad or not same
    trl = run_trl(a)
    to_trl = {}
    for n, _, r, extra in runs:
        for label, (gpus, trl_step) in trl.items():
            if gpus == _gpus(r, extra):
                colocated = label == str(gpus)  # GRPOTrainer with vLLM in each process: the runs' plain key
                key = n if colocated else f"{n} / {label}"
                to_trl[key] = step[n] / trl_step
                print(f"{n} on {gpus} GPU(s): step {step[n]:.3f} s, TRL's {trl_step:.3f} s"
                      f"{'' if colocated else f' ({label})'}: SPIRL / TRL x{to_trl[key]:.2f}")
    first_k = next(n for n, k, *_ in runs if k)
    for key in ("offpolicy/staleness", "offpolicy/ratio_mean", "offpolicy/ratio_std", "offpolicy/ratio_clipped_frac"):
        vals = [row[key] for row in steps[first_k].values() if key in row]
        if vals:
            print(f"{key}: mean {statistics.fmean(vals):.4f} over {len(vals)} steps ({first_k})")
    print(json.dumps({"step_s": {n: step[n] for n in names}, "ratio_to_" + base: {n: v / step[base]
                                                                               for n, v in out.items()},
                      "trl_step_s": {label: t for label, (_, t) in trl.items()}, "ratio_to_trl": to_trl}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
