"""One GRPO run: setup, the step loop, checkpoints and resume (the step itself: spirl/loops/trainer.py).

Setup order: cheap checks first (spirl/core/preflight.py), so that a bad setup fails in one line
(spirl.core.errors) before anything heavy is loaded:
  1. the config (spirl.core.config); --out-dir and --checkpoint-dir writable;
  2. --engine vllm: VLLM_BATCH_INVARIANT=1, vLLM importable at the pinned version;
  3. the model resolved (a local directory, a Hub repo id, or `random:<shape>`) and validated from
     config.json and the safetensors headers alone (`validate_model_dir`: no tensor is read), so
     an empty directory is reported as a missing checkpoint, not as a missing tokenizer; this is the
     one read and check of config.json, passed down as a ModelDir;
  4. --resume: the checkpoint readable, written for this model (shapes), and its run started from
     this very model (the reference policy: `model_fingerprint`);
  5. the trainer's device: CUDA present for --engine vllm or --device cuda;
  6. the tokenizer and the task; every known prompt + --max-new-tokens within the engine's
     max_model_len (tasks whose prompts are not known up front: checked per generate call);
  7. on CUDA: the memory plan (spirl.core.memory_plan) refuses a run that would not fit;
  8. the policy (fp32 masters, compute model, reference), from the run's PolicySpec
     (`TrainConfig.policy_spec`), the engine (which gets the trainer's exact weights), then steps.
Metrics: one TensorBoard scalar set and one metrics.jsonl line per step (spirl.core.metrics);
checkpoints every `checkpoint_every` steps and after the last (spirl.core.checkpoint).
Interrupts: SIGINT stops the run where it is (logging a step and writing a checkpoint finish
first); the logs are flushed, no partial checkpoint is left, and the one line says which --resume
continues the run (exit status 130). SIGTERM (a scheduler's preemption: Slurm, Kubernetes, torchrun
stopping its workers) during training stops the run at the next safe point, on every rank together:
after the rollout of the step in progress (which is then dropped: nothing of it was applied) or after
the step; a checkpoint of the last completed step is written unless one exists, and the run exits 0.
The wait is bounded by the phase in progress (one rollout, or one step's training and checkpoint).
More SIGTERMs change nothing (a scheduler may signal every process of the job and torchrun forward it
again); SIGINT stops at once. During setup SIGTERM stops at once (exit status 143): nothing to save.
Several ranks (torchrun): a PeerWatch (spirl.core.faults) stops every rank within seconds when one
dies or fails, with one line naming it (exit status 9 on the others).
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from torchtitan_compat.config import ModelDir

from ..core import checkpoint as ckpt
from . import trainer
from ..core.config import TrainConfig, checkpoint_dict, to_dict
from ..core.distributed import World, check_distributed_config, check_distributed_task, init_world, launched_by_torchrun
from ..core.errors import UserError
from ..core.faults import PeerWatch
from .evaluation import evaluate, require_eval_set
from . import precompile as warmup
from .rollout import DataCursor, PromptSource, ordered
from ..core.metrics import MetricsLogger
from ..core.preflight import (
    LengthCheckedEngine,
    check_memory,
    check_prompt_lengths,
    check_resume,
    engine_max_model_len,
    load_checked_tokenizer,
    model_fingerprint,
    resolve_device,
    resolve_model,
    validate_model_dir,
)
from ..core.build import build_policy_and_engine
from ..core.policy import Policy, resume_into, sync_weights
from ..core.spec import PolicySpec

log = logging.getLogger("spirl.loops.run")

_NATIVE = "; on a machine without vLLM/CUDA use --engine native --dtype float32"


def save_checkpoint(cfg: TrainConfig, policy: Policy, spec: PolicySpec, step: int, model_dir: Path,
                    reference: dict | None = None, watch=None, data_position: int | None = None) -> Path | None:
    """Collective when sharded: every rank gathers, rank 0 writes the one-GPU format (so the run
    resumes on any number of GPUs), and a failed write fails every rank. Replicated state (LoRA on
    several ranks) is first checked to be bitwise the same on every rank. `watch`: the PeerWatch,
    told that rank 0's write must not be cut. `data_position`: where a dataset's order continues
    (spirl.loops.rollout.DataCursor), for the tasks read in order."""
    from ..core.distributed import check_replicas

    world = policy.world
    state = {"config": checkpoint_dict(cfg), "model_dir": str(model_dir), "world_size": world.size}
    if reference is not None:
        state["reference"] = reference
    if data_position is not None:
        state["data_position"] = data_position
    masters = {name: world.full_cpu(p) for name, p in policy.masters.items()}
    opt = ckpt.optimizer_tensors(policy.optimizer, world.full_cpu)
    if world.sharded and not policy.fsdp:
        check_replicas({**masters, **opt[0]}, world, "adapters and their optimizer state")
    adapter = None
    if getattr(policy, "spec", None) is not None:  # LoRA: the masters are written as a PEFT adapter
        from ..core.lora import adapter_writer

        adapter = adapter_writer(policy, spec, (reference or {}).get("fingerprint", ""))
    path, error = None, None
    if world.is_main:
        try:
            with watch.local_write() if watch is not None else nullcontext():
                path = ckpt.save(Path(cfg.checkpoint_dir) / cfg.run_name, step, masters, opt, state, adapter)
        except UserError as e:
            error = e
    world.raise_if_any(error)
    if path is not None:
        log.info("checkpoint: %s", path)
    return path


# -- interrupts -----------------------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (`signum`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Signals:
    """SIGINT (and SIGTERM before `graceful` is set) raises Interrupted: at once, or inside `deferred()`
    when the block ends (a second signal meanwhile raises at once). Once `graceful` is set (the step
    loop runs), SIGTERM only sets `stop_requested`: the run stops at its next safe point (`_train`).
    Installed only in the main thread; restored on exit."""

    def __init__(self):
        self.depth, self.pending, self.previous = 0, None, {}
        self.graceful = False
        self.stop_requested = False
        self.stop_requested_at: float | None = None
        """time.monotonic() of the SIGTERM that set stop_requested."""

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGTERM and self.graceful:
            if not self.stop_requested:
                self.stop_requested, self.stop_requested_at = True, time.monotonic()
                log.warning("SIGTERM: stopping at the next safe point (after this rollout or this step), then a "
                            "checkpoint and exit 0 (SIGINT stops at once)")
            return
        if self.depth and self.pending is None:
            self.pending = signum
            return
        raise Interrupted(signum)

    @contextmanager
    def deferred(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)


def _interrupted(e: KeyboardInterrupt, cfg: TrainConfig, progress: dict) -> UserError:
    signum = getattr(e, "signum", signal.SIGINT)
    step, done = progress.get("step"), progress.get("done")
    if step is None:
        where = "during setup"
    elif done == step:
        where = f"after step {step}; the logs are flushed"
    else:
        where = f"during step {step} (not logged, not saved); the logs are flushed"
    root = Path(cfg.checkpoint_dir) / cfg.run_name
    try:
        latest = ckpt.resolve(root)
    except ckpt.CheckpointError:
        latest = None
    if latest is not None:
        how = f"the last checkpoint is {latest}: continue with --resume {root}"
    elif cfg.resume:
        how = f"no new checkpoint was written: continue with --resume {cfg.resume}"
    else:
        how = "no checkpoint was written yet: start the run again"
    return UserError(f"interrupted by {signal.Signals(signum).name} {where}; {how}", 128 + signum)


# -- the run --------------------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> list[dict]:
    """Run cfg.steps GRPO steps; returns the per-step metrics (also logged)."""
    progress: dict = {"step": None, "done": None, "saved": None, "position": None, "watch": None}
    with _Signals() as signals:
        try:
            return _train(cfg, signals, progress)
        except KeyboardInterrupt as e:
            raise _interrupted(e, cfg, progress) from None
        except BaseException as e:
            if progress["watch"] is None:
                raise
            raise _on_rank_error(e, progress["watch"]) from None
        finally:
            if progress["watch"] is not None:
                progress["watch"].close()


def _on_rank_error(e: BaseException, watch) -> BaseException:
    """Under torchrun: the error to report for `e`, raised on this rank. An error of a collective (a peer
    died inside it) becomes the first failure the PeerWatch knows of; any other is published, so the
    other ranks stop naming it, and reported as it is."""
    import torch.distributed as dist

    from ..core.errors import EXIT_PEER_FAILED, UserError, classify, one_line

    known = classify(e)
    text = str(e)
    if known is None and (isinstance(e, dist.DistError) or "gloo" in text or "NCCL" in text):
        watch.reporting()  # a collective failed: did a peer die inside it? The watch finds out
        peer = watch.peer_failure(wait=watch.stale_after + 2 * watch.interval)
        if peer:
            return UserError(f"{peer}; rank {watch.rank} stopped too", EXIT_PEER_FAILED)
    line = known[1] if known else f"internal error: {type(e).__name__}: {one_line(text)[:200]}"
    first = watch.failing(line)
    if first.partition(": ")[2] != line:  # another rank failed first (not the same error on every rank)
        return UserError(f"{first}; rank {watch.rank} stopped too", EXIT_PEER_FAILED)
    return e


def _train(cfg: TrainConfig, signals: _Signals, progress: dict) -> list[dict]:
    from ..core.errors import require_batch_invariant, require_cuda, require_vllm, require_writable_dir
    from ..tasks import get_task

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.top_k != -1 or cfg.top_p != 1.0:
        log.warning("--top-k/--top-p truncate the sampling distribution, but the trainer's logprobs are of the raw "
                    "logits (--logprobs raw): the trained policy is not the one that sampled (off-policy)")
    if cfg.importance_sampling_level == "sequence" and cfg.loss_type != "grpo":
        log.warning("--importance-sampling-level sequence with --loss-type %s sums per-token losses of a per-sequence "
                    "ratio; GSPO's paper (and TRL's advice) pairs it with --loss-type grpo", cfg.loss_type)
    run_dir = Path(cfg.out_dir) / cfg.run_name
    require_writable_dir(run_dir, "--out-dir")
    require_writable_dir(Path(cfg.checkpoint_dir) / cfg.run_name, "--checkpoint-dir")
    if cfg.engine == "vllm":
        require_batch_invariant(_NATIVE)
        require_vllm(_NATIVE)
    world = None
    if launched_by_torchrun():  # join the ranks first: every later check runs on every rank alike
        world = init_world(resolve_device(cfg.device))
        progress["watch"] = PeerWatch(world.rank, dict(enumerate(world.gather(PeerWatch.identity())))).start()
        progress["watch"].stopping = lambda: signals.stop_requested_at
        check_distributed_config(cfg, world)
        if not world.is_main:  # rank 0 writes a random:<shape> checkpoint once
            world.barrier()
    model_dir = resolve_model(cfg.model, cfg.checkpoint_dir)
    if world is not None and world.is_main:
        world.barrier()
    model = ModelDir(model_dir, *validate_model_dir(model_dir))  # config.json read and checked here, once
    model_args = model.args
    reference = {"model": cfg.model, "model_dir": str(model_dir), "fingerprint": model_fingerprint(model_dir)}
    lora = None
    if cfg.lora:  # the adapter's spec (rank checked against the layers, --lora-init read) before anything heavy
        from ..core.lora import resolve_spec

        lora = resolve_spec(cfg, model_args, model_dir, reference["fingerprint"])
    resumed = None
    if cfg.resume:
        resumed = check_resume(cfg.resume, model_args, reference, None if lora is None else lora.spec)
    if cfg.engine == "vllm":
        require_cuda("--engine vllm", _NATIVE)
    device = world.device if world is not None else resolve_device(cfg.device)
    world = world or World(device=device)
    tokenizer = load_checked_tokenizer(model_dir)
    if cfg.dataset:
        from ..tasks import dataset

        task = dataset.make(tokenizer, cfg)
    else:
        task = get_task(cfg.task, tokenizer, cfg)
    cursor = DataCursor(_data_position(resumed, task))
    prompt_source = PromptSource(task, cfg.seed, cursor)
    require_eval_set(task, cfg)
    check_distributed_task(task, cfg, world)
    limit, source = engine_max_model_len(cfg, model_args)
    longest_prompt = check_prompt_lengths(task, cfg, limit, source)
    if device.type == "cuda":
        single_turn = longest_prompt is not None and not getattr(task, "multi_turn", False)
        check_memory(cfg, model_args, device, longest_prompt + cfg.max_new_tokens if single_turn else limit,
                     world.size if world.sharded and lora is None else 0, None if lora is None else lora.spec)
    spec = cfg.policy_spec(lora)
    policy, engine = build_policy_and_engine(model, spec, device, world)
    start = resume_into(policy, cfg.resume, device) if cfg.resume else 0
    if longest_prompt is None:
        engine = LengthCheckedEngine(engine, cfg, limit, source)
    sync_weights(engine, policy, spec)  # the engine starts from the trainer's exact weights (matters on resume)
    with warmup.TritonBuilds() as builds:  # after the engine is built: vLLM installs its JIT monitor in its warm-up
        first_scalars = {}  # step 1's extra scalars: what the precompile built
        if warmup.wanted(cfg, device):
            first_scalars = warmup.precompile(engine, policy, cfg, device, model_args, builds)
        logger = MetricsLogger(run_dir, {"args": to_dict(cfg), "seed": cfg.seed, "model_dir": str(model_dir),
                                         "device": str(device), "world_size": world.size, "reference": reference},
                               resume_step=start if cfg.resume else None) if world.is_main else _NoLogger()
        history = []
        progress["saved"] = start if cfg.resume else None
        watch = progress["watch"]
        stop = lambda: world.any(signals.stop_requested)  # noqa: E731 - decided by every rank together
        save = lambda step, position: _save(cfg, policy, spec, step, model_dir, reference, watch, progress,  # noqa: E731
                                            position if ordered(task) else None)
        signals.graceful = True
        try:
            if cfg.eval_every and start == 0:  # the baseline: one eval before the first step
                logger.log_step(0, evaluate(engine, task, cfg, world, step=0), cfg.steps)
            for step in range(start + 1, cfg.steps + 1):
                progress["step"] = step
                before, first_variant = Counter(builds.names), len(builds.variants)
                scalars = trainer.run_step(step, cfg, task, engine, policy, spec, device, run_dir, prompt_source, stop)
                if scalars is None:  # SIGTERM during the rollout: the step is dropped, nothing of it applied
                    _stop_early(cfg, f"during step {step} (after its rollout; the step is dropped)", progress, save)
                    break
                built = builds.names - before  # kernels compiled or loaded in this step, this rank
                scalars["triton/builds"] = sum(built.values())
                if built:
                    log.info("step %d built %d Triton kernels: %s", step, scalars["triton/builds"],
                             ", ".join(f"{k} x{v}" for k, v in sorted(built.items())))
                    for variant in builds.variants[first_variant:]:  # what a precompile would have to cover
                        (log.info if cfg.precompile else log.debug)("step %d built %s", step, variant)
                scalars.update(first_scalars)
                first_scalars = {}
                if cfg.eval_every and step % cfg.eval_every == 0:
                    scalars.update(evaluate(engine, task, cfg, world, step=step))
                with signals.deferred():  # a step's log line and its checkpoint are written whole
                    logger.log_step(step, scalars, cfg.steps)
                    history.append(scalars)
                    if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                        save(step, cursor.position)
                    progress["done"], progress["position"] = step, cursor.position
                if step < cfg.steps and stop():
                    _stop_early(cfg, f"after step {step}", progress, save)
                    break
        finally:
            logger.close()
            if not world.sharded:
                engine.close()  # frees the GPU and ends vLLM's torch.distributed world: a clean exit
    if world.sharded:  # every rank done before the shared process group goes
        watch.done()  # a rank that ends first is no failure (train() closes the watch)
        world.barrier()
        engine.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return history


def _save(cfg, policy, spec, step, model_dir, reference, watch, progress, position: int | None) -> None:
    save_checkpoint(cfg, policy, spec, step, model_dir, reference, watch, position)
    progress["saved"] = step


def _stop_early(cfg: TrainConfig, when: str, progress: dict, save) -> None:
    """SIGTERM: the last completed step checkpointed (unless it is already), one line, and the run ends
    normally (exit status 0)."""
    done = progress["done"]
    if done is not None and progress["saved"] != done:
        save(done, progress["position"])  # the data position after that step, not after the dropped rollout
    root = Path(cfg.checkpoint_dir) / cfg.run_name
    if done is None and progress["saved"] is None:
        how = "no step was completed, so there is no checkpoint: start the run again"
    else:
        how = f"continue with --resume {root}"
    log.warning("stopped by SIGTERM %s: the last completed step is %s; %s", when,
                done if done is not None else progress["saved"], how)


def _data_position(resumed, task) -> int:
    """Where a task read in order (a dataset, reasoning-gym) continues: the resumed checkpoint's position,
    else 0."""
    if resumed is None or not ordered(task):
        return 0
    position = resumed.state.get("data_position")
    if not isinstance(position, int) or position < 0:
        raise ckpt.CheckpointError(f"--resume {resumed.path} records no data position (it was written by a run "
                                   "that did not read a dataset in order), so this run cannot continue its data "
                                   "order; resume a checkpoint of this --dataset / --task run")
    return position


class _NoLogger:
    """Ranks other than 0 log nothing (rank 0 logs the reduced scalars of every rank)."""

    def log_step(self, *args) -> None:
        pass

    def close(self) -> None:
        pass
