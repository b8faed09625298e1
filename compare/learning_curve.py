"""From nothing to a learning curve: make a starting model, run GRPO with held-out evals, plot.

    VLLM_BATCH_INVARIANT=1 python compare/learning_curve.py --out runs/curve    # one GPU, a few minutes

Stages, each its own process (vLLM reads its environment at import), each logged to <out>/*.log:
  1. weights.py --random small           a random Qwen3-shaped model (real tokenizer and vocabulary)
  2. spirl.loops.warmstart --task arith        supervised steps on a teacher that forgets carries
                                         (--correct-share of its answers are right; see
                                         docs/learning-curve.md for why)
  3. simple_rl.py --task arith           GRPO with --eval-every: greedy accuracy on the 500
                                         held-out problems before the first step and every N steps
  4. compare/plot_run.py                 <out>/curve.png
Then prints the first eval, the best of the last three, the gain in points and the parity totals,
and exits 1 if the gain is below --min-gain or any step found a differing token.

LoRA next to full fine-tuning (`--lora-ranks 1,8 --lora-lrs 5e-4,2e-3,8e-3`): stage 3 also runs one
LoRA GRPO run (every linear layer, alpha 32) per rank and learning rate, from the same warm-started
model with the same seed, one after another (a run of the default size takes under a minute).
Per rank, the learning rate whose best-of-last-3 eval is highest (ties: the higher mean over all
evals) is chosen; <out>/curves.png plots full fine-tuning and each rank's chosen run, <out>/sweep.png every
run. --min-gain applies to full fine-tuning; parity (0 differing tokens) to every run.
Asynchronous next to synchronous (`--off-policy-steps 0,1`): one full fine-tuning run per K from the same
warm-started model and seed; <out>/offpolicy.png draws them together; --min-gain applies to each.
Same --seed, same numbers: every stage is seeded and runs bitwise-deterministic kernels.
`--engine native --device cpu` runs the same pipeline on CPU (slowly; the tests use it tiny).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from compare.plot_run import load_run, summary

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="new directory for models, logs, the run and the PNG")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="small", help="weights.py shape of the starting model")
    p.add_argument("--sft-steps", type=int, default=3000)
    p.add_argument("--sft-batch", type=int, default=256)
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--correct-share", type=float, default=0.3, help="share of the teacher's answers that are right")
    p.add_argument("--steps", type=int, default=200, help="GRPO steps")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4, help="GRPO learning rate")
    p.add_argument("--kl-coef", type=float, default=0.001)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="vLLM's share of the GPU")
    p.add_argument("--engine", default="vllm", choices=("vllm", "native"))
    p.add_argument("--device", default="auto")
    p.add_argument("--min-gain", type=float, default=20.0, help="points of eval accuracy the run must gain")
    p.add_argument("--lora-ranks", default="", help="comma-separated LoRA ranks to run next to full fine-tuning")
    p.add_argument("--lora-lrs", default="2e-3", help="comma-separated learning rates each LoRA rank runs with")
    p.add_argument("--full", type=int, default=1, choices=(0, 1), help="0: no full fine-tuning run")
    p.add_argument("--off-policy-steps", default="0", help="comma-separated K: one full fine-tuning run per K "
                   "(simple_rl.py --off-policy-steps), plotted together in <out>/offpolicy.png")
    a = p.parse_args(argv)
    try:
        a.ranks = [int(r) for r in a.lora_ranks.split(",") if r.strip()]
        a.lrs = [float(x) for x in a.lora_lrs.split(",") if x.strip()]
        a.ks = [int(k) for k in a.off_policy_steps.split(",") if k.strip()]
    except ValueError:
        p.error("--lora-ranks and --off-policy-steps take integers and --lora-lrs numbers, comma-separated")
    if not a.ks or min(a.ks) < 0 or len(set(a.ks)) != len(a.ks):
        p.error("--off-policy-steps takes distinct integers >= 0, comma-separated (0: synchronous)")
    if a.ranks and not a.lrs or not a.full and not a.ranks:
        p.error("nothing to run: give --lora-lrs with --lora-ranks, or keep --full 1")
    return a


def stage(name: str, cmd: list[str], out: Path) -> None:
    """Run one stage, its output to <out>/<name>.log; a failure is one line naming the log."""
    t0 = time.perf_counter()
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
    if rc:
        raise SystemExit(f"learning_curve: error: stage {name} failed with exit status {rc}; see {out / name}.log")
    print(f"[{name}] done in {time.perf_counter() - t0:.0f}s", flush=True)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.out.exists() and any(a.out.iterdir()):
        print(f"learning_curve: error: {a.out} is not empty; give a new --out directory", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    py, models = sys.executable, a.out / "models"
    device = ["--device", a.device]
    stage("1_random_model", [py, "weights.py", "--random", a.shape, "--seed", str(a.seed),
                             "--out", str(models / "random")], a.out)
    stage("2_warmstart", [py, "-m", "spirl.loops.warmstart", "--task", "arith", "--model", str(models / "random"),
                          "--out", str(models / "sft"), "--steps", str(a.sft_steps), "--batch", str(a.sft_batch),
                          "--lr", str(a.sft_lr), "--correct-share", str(a.correct_share), "--seed", str(a.seed),
                          *device], a.out)
    native = ["--engine", "native", "--dtype", "float32"] if a.engine == "native" else []
    runs = ({full_name(k): (a.lr, ["--off-policy-steps", str(k)] if k else []) for k in a.ks} if a.full else {}) | {
        f"arith-lora{r}-lr{lr:g}": (lr, ["--lora-rank", str(r)]) for r in a.ranks for lr in a.lrs}
    grpo = {name: [py, "simple_rl.py", "--model", str(models / "sft"), "--task", "arith",
                   "--steps", str(a.steps), "--eval-every", str(a.eval_every),
                   "--prompts-per-step", str(a.prompts_per_step), "--group-size", str(a.group_size),
                   "--max-new-tokens", "6", "--temperature", "1.0", "--lr", f"{lr:g}", "--kl-coef", str(a.kl_coef),
                   "--seed", str(a.seed), "--out-dir", str(a.out / "runs"), "--run-name", name,
                   "--checkpoint-dir", str(a.out / "checkpoints"), "--checkpoint-every", "0",
                   "--gpu-memory-utilization", str(a.gpu_memory_utilization), *flags, *native, *device]
            for name, (lr, flags) in runs.items()}
    if len(grpo) == 1:
        stage("3_grpo", next(iter(grpo.values())), a.out)
    else:
        stages(grpo, a.out)
    series = {name: load_run(a.out / "runs" / name) for name in runs}
    sums = {name: summary(s) for name, s in series.items()}
    if a.full:
        first = full_name(a.ks[0])
        stage("4_plot", [py, "compare/plot_run.py", str(a.out / "runs" / first), "--out", str(a.out / "curve.png")],
              a.out)
    ok = report(sums, a.min_gain)
    if a.full and len(a.ks) > 1:
        from compare.plot_run import plot_runs

        plot_runs({("synchronous (K = 0)" if k == 0 else f"--off-policy-steps {k}"): series[full_name(k)]
                   for k in a.ks}, f"GRPO on arith: synchronous vs asynchronous (same warm start, seed {a.seed})",
                  a.out / "offpolicy.png")
        print(f"off-policy curves: {a.out / 'offpolicy.png'}")
    if a.ranks:
        from compare.plot_run import plot_runs

        chosen = {f"full fine-tuning, lr {a.lr:g}": full_name(a.ks[0])} if a.full else {}
        for r in a.ranks:
            mine = [n for n in runs if n.startswith(f"arith-lora{r}-")]
            best = max(mine, key=lambda n: (sums[n]["best_last3_eval_accuracy"], mean_eval(series[n])))
            chosen[f"LoRA rank {r}, lr {runs[best][0]:g}"] = best
            print(f"LoRA rank {r}: learning rate {runs[best][0]:g} chosen (best of the last 3 evals: "
                  + ", ".join(f"lr {runs[n][0]:g} {sums[n]['best_last3_eval_accuracy']:.1f}%" for n in mine) + ")")
        plot_runs({label: series[n] for label, n in chosen.items()}, "GRPO on arith: full fine-tuning vs LoRA "
                  f"(same warm start, seed {a.seed})", a.out / "curves.png")
        plot_runs({n: series[n] for n in runs}, "learning-rate sweep", a.out / "sweep.png")
        print(f"curves: {a.out / 'curves.png'}, sweep: {a.out / 'sweep.png'}")
    return 0 if ok else 1


def full_name(k: int) -> str:
    """The run name of full fine-tuning with --off-policy-steps k."""
    return "arith" if k == 0 else f"arith-offpolicy{k}"


def report(sums: dict[str, dict], min_gain: float) -> bool:
    """One line per run; True when every run found 0 differing tokens and every full fine-tuning run (each K)
    gained at least min_gain points."""
    ok = True
    for name, s in sums.items():
        full = "-lora" not in name
        gain = s["best_last3_eval_accuracy"] - s["first_eval_accuracy"]
        good = s["parity_tokens_different"] == 0 and (not full or gain >= min_gain)
        ok &= good
        print(f"{name}: eval accuracy {s['first_eval_accuracy']:.1f}% before GRPO, {s['best_last3_eval_accuracy']:.1f}% "
              f"best of the last 3 evals: {gain:+.1f} points over {s['steps']} steps; parity "
              f"{s['parity_tokens_compared']} tokens compared, {s['parity_tokens_different']} different; "
              f"{'OK' if good else 'NOT MET'}" + (f" (needs >= {min_gain:g} points and 0 different)"
                                                   if full else " (needs 0 different)"))
    return ok


def mean_eval(series) -> float:
    """Mean held-out accuracy over every eval of a run: of two runs that end equally, the faster."""
    values = [v for _, v in series.get("eval/accuracy", [])]
    return sum(values) / max(1, len(values))


def stages(cmds: dict[str, list[str]], out: Path) -> None:
    """Run the GRPO stages one after another, each logging to <out>/3_grpo_<name>.log. Not side by
    side: vLLM sizes its KV cache from the GPU's free memory while it starts, and another process
    allocating or freeing meanwhile fails that start (seen on the H100: "Error in memory profiling")."""
    for name, cmd in cmds.items():
        stage(f"3_grpo_{name}", cmd, out)


if __name__ == "__main__":
    sys.exit(main())
