"""Acceptance checks and scaling of training on several GPUs, each a simple_rl.py run; one table.

    VLLM_BATCH_INVARIANT=1 python compare/multi_gpu.py --out /tmp/mg --lora-rank 64   # correctness, LoRA, 2 GPUs
    VLLM_BATCH_INVARIANT=1 python compare/multi_gpu.py --out /tmp/mg --only samples,resume   # full fine-tuning
    VLLM_BATCH_INVARIANT=1 python compare/multi_gpu.py --out /tmp/mg --only scaling,trl       # speed, and TRL
    VLLM_BATCH_INVARIANT=1 python compare/multi_gpu.py --out /tmp/mg --only big --big-model random:Qwen3-32B \\
        --big-lora-rank 32 --big-args="--gpu-memory-utilization 0.6"
    python compare/multi_gpu.py --out /tmp/mg --engine native --device cpu --model random:tiny       # CPU, gloo

Correctness checks, on --model with --lora-rank R (0: full fine-tuning), --prompts-per-rank prompts per rank,
3 steps, a checkpoint after every step. Each prints what it measured and PASS/FAIL; exit status 1 if any failed.
  samples  one GPU (`one`) and --ranks ranks (`many`): step 1 draws the same samples (rewards, lengths, parity
           counts) and every rank compares every token, 0 different, at every step
  repeat   `many` again (`again`): identical per-step scalars, identical bytes of every checkpoint file kept
           (steps 2 and 3: a run keeps its last two)
  faults   `many` again (`killed`), rank --ranks-1 SIGKILLed once step 2's checkpoint exists: every rank gone
           within --fault-bound s of the kill, each survivor's stderr one line naming the killed rank, the
           latest checkpoint step 2, intact and byte for byte `many`'s (so this run is also a repeat)
  resume   --ranks -> 1: one process resumes step 2 of `killed` (else `many`) and samples `many`'s step 3;
           1 -> --ranks: --ranks ranks resume `one`'s step 2 and sample `one`'s step 3
  nodes    --ranks nodes x 1 GPU (one torchrun agent per GPU, a c10d rendezvous on this host, as on several
           hosts): every scalar and every checkpoint byte of `many`
Speed, at the real shape (--scaling-prompts-per-rank x --group-size x --scaling-max-new-tokens, no checkpoints,
medians of steps 2.. per phase, `compare/phase_table.py`'s):
  scaling  weak: the same per-GPU batch on 1 GPU and on --ranks GPUs (efficiency = t1 / tN, goal >= 0.9);
           strong: the 1-GPU batch split over --ranks GPUs (speed-up t1 / tN)
  trl      TRL's GRPOTrainer (compare/trl_grpo.py under `accelerate launch`, vLLM colocated) on --ranks GPUs at
           the weak-scaling shape, next to SPIRL's step on the same GPUs
  big      --big-model (--big-lora-rank) on --ranks ranks: --steps-big steps, 0 different on every rank, per-phase
           times and the peak memory of the busiest GPU
Runs write under --out (logs, per-rank logs, metrics, checkpoints: a full fine-tuning checkpoint is 12 bytes per
parameter, 98 GB at Qwen3-8B: point --out at a large disk).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("samples", "repeat", "faults", "resume", "nodes", "scaling", "trl", "big")
SAME_SAMPLES = ("reward_mean", "reward_std", "parity/tokens_compared", "parity/tokens_different",
                "completion_len_mean", "tokens_trained")


class RunFailed(RuntimeError):
    pass


def _env(args, gpus: str | None = None) -> dict:
    """`gpus`: indices among the GPUs this script sees (its own CUDA_VISIBLE_DEVICES, if set: two of these scripts
    can share a host, each on its own GPUs)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if gpus is not None and args.engine == "vllm":
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(seen.split(",")[int(i)] for i in gpus.split(",")) if seen else gpus
    return env


def _argv(args, name: str, model: str, extra: list[str]) -> list[str]:
    cmd = [str(REPO / "simple_rl.py"), "--model", model, "--engine", args.engine, "--task", "synthetic",
           "--group-size", str(args.group_size), "--temperature", "0.7", "--out-dir", str(args.out / "runs"),
           "--checkpoint-dir", str(args.out / "ck"), "--run-name", name, *extra]
    if args.engine == "native":
        cmd += ["--dtype", "float32", "--device", args.device]
    return cmd


def _torchrun(ranks: int, log_dir: Path, nodes: int = 1, port: int = 0, rdzv: str = "") -> list[str]:
    head = [sys.executable, "-m", "torch.distributed.run", f"--log-dir={log_dir}", "--redirects=3"]
    if nodes == 1:
        return head + ["--standalone", f"--nproc-per-node={ranks}"]
    return head + [f"--nnodes={nodes}", f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv}"]


def _metrics(args, name: str) -> dict[int, dict]:
    path = args.out / "runs" / name / "metrics.jsonl"
    return {m["step"]: m for m in map(json.loads, path.read_text().splitlines())} if path.is_file() else {}


def run(args, name: str, ranks: int, model: str, extra: list[str], gpus: str | None = None) -> dict[int, dict]:
    """One simple_rl.py run: `ranks` = 0 is one plain process; its metrics.jsonl by step."""
    argv = _argv(args, name, model, extra)
    cmd = [sys.executable, *argv] if ranks == 0 else _torchrun(ranks, args.out / "ranks" / name) + argv
    log = args.out / f"{name}.log"
    print(f"[{name}] {shlex.join(cmd[1:])}  (log: {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(args, gpus)).returncode
    print(f"[{name}] exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
    if rc != 0:
        raise RunFailed(f"run {name} exited with {rc}; see {log}")
    return _metrics(args, name)


def run_nodes(args, name: str, model: str, extra: list[str]) -> dict[int, dict]:
    """--nodes nodes x (--ranks / --nodes) ranks: one torchrun agent per node, each with its own GPUs, meeting at
    a c10d rendezvous on this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = _argv(args, name, model, extra)
    nodes = args.nodes or args.ranks
    per = args.ranks // nodes
    procs = []
    for node in range(nodes):
        cmd = _torchrun(per, args.out / "ranks" / f"{name}_node{node}", nodes, port, name) + argv
        log = open(args.out / f"{name}_node{node}.log", "w")
        gpus = ",".join(str(node * per + i) for i in range(per))
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                       env=_env(args, gpus if args.engine == "vllm" else None)), log))
    print(f"[{name}] {nodes} torchrun agents x {per} rank(s), rendezvous 127.0.0.1:{port}", flush=True)
    rcs = [p.wait() for p, _ in procs]
    if any(rcs):
        raise RunFailed(f"run {name} exited with {rcs}; see {args.out}/{name}_node*.log")
    return _metrics(args, name)


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()[:16]


def checkpoint_shas(args, name: str, step: int) -> dict[str, str]:
    d = args.out / "ck" / name / f"step_{step:06d}"
    return {p.name: _sha(p) for p in sorted(d.iterdir()) if p.is_file()}


def _scalars(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(("time/", "memory/"))}


def _parity_ok(m: dict, ranks: int) -> bool:
    per_rank = ranks <= 1 or all(m.get(f"parity/rank{r}/tokens_compared", 0) > 0 and
                                 m.get(f"parity/rank{r}/tokens_different", 1) == 0 for r in range(ranks))
    return m["parity/tokens_compared"] > 0 and m["parity/tokens_different"] == 0 and per_rank


def _parity_line(m: dict, ranks: int) -> str:
    return ", ".join(f"rank {r} {int(m[f'parity/rank{r}/tokens_compared'])} compared "
                     f"{int(m[f'parity/rank{r}/tokens_different'])} different" for r in range(ranks))


def _same_samples(a: dict, b: dict) -> bool:
    return {k: a[k] for k in SAME_SAMPLES} == {k: b[k] for k in SAME_SAMPLES}


# -- correctness ----------------------------------------------------------------------------------------


def _common(args, steps: int = 3) -> list[str]:
    lora = ["--lora-rank", str(args.lora_rank), "--lr", str(args.lr)] if args.lora_rank else ["--lr", str(args.lr)]
    return ["--prompts-per-step", str(args.prompts_per_rank * args.ranks), "--max-new-tokens",
            str(args.max_new_tokens), "--steps", str(steps), "--checkpoint-every", "1", *lora, *args.extra]


def check_samples(args, res: dict) -> bool:
    one = run(args, "one", 0, args.model, _common(args), gpus="0")
    many = run(args, "many", args.ranks, args.model, _common(args))
    res["one"], res["many"] = one, many
    same = _same_samples(one[1], many[1])
    parity = all(_parity_ok(m, args.ranks) for m in many.values()) and all(_parity_ok(m, 1) for m in one.values())
    for s, m in sorted(many.items()):
        print(f"  samples step {s}: {_parity_line(m, args.ranks)}; reward {m['reward_mean']:.4f} ({args.ranks} ranks) "
              f"vs {one[s]['reward_mean']:.4f} (1 GPU)")
    print(f"  samples: step 1 the same samples on 1 GPU and {args.ranks} ranks: {same}; parity 0 everywhere: {parity}")
    return same and parity and len(many) == 3


def _ensure_many(args, res: dict) -> None:
    if "many" not in res:
        res["many"] = run(args, "many", args.ranks, args.model, _common(args))


def check_repeat(args, res: dict) -> bool:
    _ensure_many(args, res)
    again = run(args, "again", args.ranks, args.model, _common(args))
    same = [_scalars(res["many"][s]) == _scalars(again[s]) for s in (1, 2, 3)]
    files = [checkpoint_shas(args, "many", s) == checkpoint_shas(args, "again", s) for s in (2, 3)]
    print(f"  repeat: scalars identical at steps 1-3: {same}; every file of the step 2 and 3 checkpoints identical: "
          f"{files}")
    return all(same) and all(files)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _rank_pid(agent: int, rank: int) -> int | None:
    for child in _children(agent):
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return child
    return None


def check_faults(args, res: dict) -> bool:
    name, victim = "killed", args.ranks - 1
    argv = _argv(args, name, args.model, _common(args, steps=6))
    cmd = _torchrun(args.ranks, args.out / "ranks" / name) + argv
    log = args.out / f"{name}.log"
    print(f"[{name}] {shlex.join(cmd[1:])}  (log: {log}); rank {victim} is killed after step 2's checkpoint", flush=True)
    latest = args.out / "ck" / name / "latest"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(args), start_new_session=True)
        killed_at = None
        while proc.poll() is None:
            if latest.is_file() and latest.read_text().strip() == "step_000002":
                pid = _rank_pid(proc.pid, victim)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                    break
            time.sleep(0.05)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if killed_at is None:
        print(f"  faults: rank {victim} was never killed (the run ended first, exit {proc.returncode})")
        return False
    took = time.monotonic() - killed_at
    lines = {}
    for f in (args.out / "ranks" / name).rglob("stderr.log"):
        rank = int(f.parent.name)
        if rank != victim:
            lines[rank] = [x for x in f.read_text().splitlines() if x.startswith("error: ")]  # vLLM's progress bars aside
    named = all(len(ls) == 1 and f"rank {victim} " in ls[0] for ls in lines.values())
    step2 = (args.out / "ck" / name / "step_000002")
    intact = latest.read_text().strip() == "step_000002" and (step2 / "state.json").is_file()
    same = "many" not in res or checkpoint_shas(args, name, 2) == checkpoint_shas(args, "many", 2)
    print(f"  faults: every rank gone {took:.1f} s after rank {victim}'s SIGKILL (bound {args.fault_bound:g} s); "
          f"survivors' one line: {lines}; latest checkpoint step 2 intact: {intact}; step 1-2 checkpoints "
          f"byte for byte `many`'s: {same}")
    res["killed"] = True
    return took <= args.fault_bound and named and intact and same


def check_resume(args, res: dict) -> bool:
    _ensure_many(args, res)
    origin = "killed" if res.get("killed") else "many"
    to = args.resume_to
    n_to_m = run(args, f"resume_n_to_{to}", 0 if to == 1 else to, args.model, _common(args) + [
        "--resume", str(args.out / "ck" / origin / "step_000002")], gpus="0" if to == 1 else None)
    same = _same_samples(n_to_m[3], res["many"][3])
    print(f"  resume {args.ranks} -> {to}: step 3 after resuming {origin}'s step 2 samples what `many` sampled: {same}; "
          f"parity 0: {_parity_ok(n_to_m[3], to)}")
    ok = same and _parity_ok(n_to_m[3], to)
    if "one" not in res:
        print("  resume 1 -> N: not run (no `one`: run samples first)")
        return ok
    one_to_n = run(args, "resume_1_to_n", args.ranks, args.model, _common(args) + [
        "--resume", str(args.out / "ck" / "one" / "step_000002")])
    same = _same_samples(one_to_n[3], res["one"][3])
    print(f"  resume 1 -> {args.ranks}: step 3 after resuming `one`'s step 2 samples what `one` sampled: {same}; parity "
          f"0 on every rank: {all(_parity_ok(m, args.ranks) for m in one_to_n.values())}")
    return ok and same and all(_parity_ok(m, args.ranks) for m in one_to_n.values())


def check_nodes(args, res: dict) -> bool:
    _ensure_many(args, res)
    nodes = run_nodes(args, "nodes", args.model, _common(args))
    same = [_scalars(res["many"][s]) == _scalars(nodes[s]) for s in (1, 2, 3)]
    files = [checkpoint_shas(args, "many", s) == checkpoint_shas(args, "nodes", s) for s in (2, 3)]
    print(f"  nodes: {args.nodes or args.ranks} nodes against 1 node x {args.ranks}: scalars identical at steps 1-3: {same}; "
          f"every file of the step 2 and 3 checkpoints identical: {files}")
    return all(same) and all(files)


# -- speed ----------------------------------------------------------------------------------------------


def _median_phases(steps: dict[int, dict]) -> dict[str, float]:
    timed = [m for s, m in sorted(steps.items()) if s > 1]
    keys = sorted({k for m in timed for k in m if k.startswith("time/")})
    return {k[5:]: statistics.median(m.get(k, 0.0) for m in timed) for k in keys}


def _phase_table(columns: dict[str, dict[str, float]]) -> None:
    phases = [p for p in ("rollout", "parity", "reference", "forward", "backward", "optimizer", "lora_merge",
                          "weight_sync", "step") if any(p in c for c in columns.values())]
    print("  " + "phase".ljust(12) + "".join(n.rjust(16) for n in columns))
    for p in phases:
        print("  " + p.ljust(12) + "".join(f"{c.get(p, 0.0):16.2f}" for c in columns.values()))


def _scaling_args(args, prompts: int) -> list[str]:
    lora = ["--lora-rank", str(args.lora_rank), "--lr", str(args.lr)] if args.lora_rank else []
    return ["--prompts-per-step", str(prompts), "--max-new-tokens", str(args.scaling_max_new_tokens), "--steps",
            str(args.steps_scaling), "--checkpoint-every", "0", *lora, *args.extra]


def check_scaling(args, res: dict) -> bool:
    p = args.scaling_prompts_per_rank
    one = run(args, "scale_1", 0, args.model, _scaling_args(args, p), gpus="0")
    weak = run(args, f"scale_weak_{args.ranks}", args.ranks, args.model, _scaling_args(args, p * args.ranks))
    strong = run(args, f"scale_strong_{args.ranks}", args.ranks, args.model, _scaling_args(args, p))
    cols = {"1 GPU": _median_phases(one), f"{args.ranks} GPUs weak": _median_phases(weak),
            f"{args.ranks} GPUs strong": _median_phases(strong)}
    res["weak"] = cols[f"{args.ranks} GPUs weak"]
    print(f"  scaling: 1 GPU {p} prompts; weak: {args.ranks} GPUs x {p} prompts; strong: {args.ranks} GPUs, {p} prompts "
          f"in all; x {args.group_size} samples x {args.scaling_max_new_tokens} new tokens; median s of steps 2..")
    _phase_table(cols)
    t1, tw, ts = (c["step"] for c in cols.values())
    parity = all(_parity_ok(m, args.ranks) for run_ in (weak, strong) for m in run_.values())
    print(f"  scaling: weak-scaling efficiency t1 / t{args.ranks} = {t1 / tw:.3f} (goal >= 0.9); strong speed-up "
          f"{t1 / ts:.2f}x on {args.ranks} GPUs; parity 0 on every rank: {parity}")
    return t1 / tw >= 0.9 and parity


def check_trl(args, res: dict) -> bool:
    from compare.trl_grpo import launch

    batch = args.scaling_prompts_per_rank * args.ranks
    trl, summary = launch(_model_dir(args, args.model), args.ranks, args.out / f"trl_{args.ranks}",
                          prompts_per_step=batch, group_size=args.group_size,
                          max_new_tokens=args.scaling_max_new_tokens, steps=args.steps_scaling, skip=1,
                          extra=("--task", "synthetic", "--lora-rank", str(args.lora_rank)))
    if trl is None:
        print(f"  trl: {summary}")
        return False
    ours = res.get("weak", {}).get("step")
    ratio = f"SPIRL / TRL = {ours / trl:.2f}x" if ours else "(run scaling for SPIRL's step)"
    print(f"  trl: TRL GRPOTrainer on {args.ranks} GPUs, {batch} prompts x {args.group_size} x "
          f"{args.scaling_max_new_tokens}: {trl:.2f} s a step; SPIRL {ours if ours else float('nan'):.2f} s; {ratio}")
    print(f"  trl: {summary}")
    return ours is not None and ours <= trl


def _model_dir(args, model: str) -> str:
    """A `random:<shape>` model as the directory simple_rl.py wrote it to (TRL needs a directory)."""
    if not model.startswith("random:"):
        return model
    from spirl.core.preflight import resolve_model

    return str(resolve_model(model, str(args.out / "ck")))


def check_big(args, res: dict) -> bool:
    lora = ["--lora-rank", str(args.big_lora_rank), "--lr", "1e-4"] if args.big_lora_rank else []
    steps = run(args, "big", args.ranks, args.big_model,
                ["--prompts-per-step", str(args.prompts_per_rank * args.ranks), "--max-new-tokens",
                 str(args.big_max_new_tokens), "--steps", str(args.steps_big), "--checkpoint-every", "0", *lora,
                 *shlex.split(args.big_args)])
    ok = len(steps) == args.steps_big and all(_parity_ok(m, args.ranks) for m in steps.values())
    for s, m in sorted(steps.items()):
        times = " ".join(f"{k[5:]} {v:.2f}s" for k, v in m.items() if k.startswith("time/"))
        peak = max((v for k, v in m.items() if k.startswith("memory/peak_gib/")), default=float("nan"))
        print(f"  big step {s}: {_parity_line(m, args.ranks)}; {times}; peak {peak:.1f} GiB (the busiest GPU)")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="a new or empty directory")
    p.add_argument("--only", default="samples,repeat,faults,resume,nodes",
                   help=f"comma-separated checks, run in this order: {','.join(CHECKS)}")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--nodes", type=int, default=0, help="nodes of the nodes check (0: --ranks nodes of 1 GPU)")
    p.add_argument("--resume-to", type=int, default=1, help="ranks the resume check resumes --ranks' checkpoint on")
    p.add_argument("--model", default="random:Qwen3-1.7B", help="model of every check but big")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank of every check but big (0: full fine-tuning)")
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate of the correctness checks")
    p.add_argument("--engine", default="vllm", choices=("vllm", "native"))
    p.add_argument("--device", default="cuda", help="native engine only: cpu or cuda")
    p.add_argument("--prompts-per-rank", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--extra", default="", help="more simple_rl.py flags for every run but big, as one string")
    p.add_argument("--fault-bound", type=float, default=10.0, help="seconds every rank must be gone in")
    p.add_argument("--scaling-prompts-per-rank", type=int, default=8)
    p.add_argument("--scaling-max-new-tokens", type=int, default=1024)
    p.add_argument("--steps-scaling", type=int, default=4)
    p.add_argument("--big-model", default="random:Qwen3-8B")
    p.add_argument("--big-lora-rank", type=int, default=0)
    p.add_argument("--big-max-new-tokens", type=int, default=512)
    p.add_argument("--big-args", default="", help="more simple_rl.py flags for big, as one string")
    p.add_argument("--steps-big", type=int, default=3)
    args = p.parse_args(argv)
    args.extra = shlex.split(args.extra)
    which = args.only.split(",")
    if not set(which) <= set(CHECKS):
        p.error(f"--only: unknown check(s) {sorted(set(which) - set(CHECKS))}; choose from {', '.join(CHECKS)}")
    if args.out.exists() and any(args.out.iterdir()):
        p.error(f"--out {args.out} is not empty; pass a new directory")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, bool] = {}
    res: dict = {}
    for check in CHECKS:
        if check not in which:
            continue
        try:
            results[check] = globals()[f"check_{check}"](args, res)
        except RunFailed as e:
            print(f"  {check}: {e}", flush=True)
            results[check] = False
    for name, ok in results.items():
        print(f"{name:8s} {'PASS' if ok else 'FAIL'}")
    return 0 if results and all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
