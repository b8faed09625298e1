"""One GRPO run: `train(cfg)` = `setup(cfg)` (spirl/loops/setup.py), then `loop(run)`; the step itself is
spirl/loops/trainer.py's `run_step`.

Metrics: one TensorBoard scalar set and one metrics.jsonl line per step (spirl.core.metrics); checkpoints
every `checkpoint_every` steps and after the last (spirl.core.checkpoint). Interrupts (spirl/loops/signals.py):
SIGINT stops the run where it is (logging a step and writing a checkpoint finish first; the one line says
which --resume continues it). SIGTERM (a scheduler's preemption: Slurm, Kubernetes, torchrun stopping its
workers) during training stops the run at the next safe point, on every rank together: after the rollout of
the step in progress (which is then dropped: nothing of it was applied) or after the step; a checkpoint of
the last completed step is written unless one exists, and the run exits 0. The wait is bounded by the phase
in progress (one rollout, or one step's training and checkpoint). Several ranks (torchrun): a PeerWatch
(spirl.core.faults) stops every rank within seconds when one dies or fails, with one line naming it (exit
status 9 on the others).
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

from ..core import checkpoint as ckpt
from ..core.config import TrainConfig, checkpoint_dict
from ..core.errors import UserError
from . import ahead, trainer
from .evaluation import evaluate
from .setup import Progress, Run, setup
from .signals import Signals, interrupted
from .timing import build_metrics

log = logging.getLogger("spirl.loops.run")


def train(cfg: TrainConfig) -> list[dict]:
    """Run cfg.steps GRPO steps; returns the per-step metrics (also logged)."""
    progress = Progress()
    with Signals() as signals:
        try:
            with setup(cfg, signals, progress) as run:
                return loop(run)
        except KeyboardInterrupt as e:
            raise interrupted(e, cfg, progress) from None
        except BaseException as e:
            if progress.watch is None:
                raise
            raise _on_rank_error(e, progress.watch) from None
        finally:
            if progress.watch is not None:
                progress.watch.close()


def loop(run: Run) -> list[dict]:
    """The steps after run.start up to cfg.steps, with the evals and checkpoints cfg asks for; stops early at
    a SIGTERM (module docstring). Returns each step's scalars."""
    cfg, history = run.cfg, []
    run.signals.graceful = True
    if cfg.eval_every and run.start == 0:  # the baseline: one eval before the first step
        run.logger.log_step(0, evaluate(run.engine, run.task, cfg, run.world, step=0), cfg.steps)
    try:
        _steps(run, history)
    finally:
        if run.begun is not None:  # a rollout begun for a step that will not run here: the engine done first
            run.begun.abandon()
            run.begun = None
    return history


def _steps(run: Run, history: list[dict]) -> None:
    cfg = run.cfg
    for step in range(run.start + 1, cfg.steps + 1):
        run.progress.step = step
        scalars = _step(run, step)
        if scalars is None:  # SIGTERM during the rollout: the step is dropped, nothing of it applied
            stop_early(run, f"during step {step} (after its rollout; the step is dropped)")
            break
        with run.signals.deferred():  # a step's log line and its checkpoint are written whole
            run.logger.log_step(step, scalars, cfg.steps)
            history.append(scalars)
            position = trainer.data_position(run)
            if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                save_checkpoint(run, step, position)
            run.progress.done, run.progress.position = step, position
        if step < cfg.steps and _stop_requested(run):
            stop_early(run, f"after step {step}")
            break


def _stop_requested(run: Run) -> bool:
    """A SIGTERM arrived on any rank: decided by every rank together."""
    return run.world.any(run.signals.stop_requested)


def _step(run: Run, step: int) -> dict | None:
    """One step's scalars with the Triton kernels it built (`triton/builds`, named in the log), the first
    step's extra scalars and an eval when one is due; None when a SIGTERM dropped it after its rollout."""
    cfg, builds = run.cfg, run.builds
    before, first_variant = Counter(builds.names), len(builds.variants)
    scalars = trainer.run_step(run, step, lambda: _stop_requested(run))
    if scalars is None:
        return None
    built = builds.names - before  # kernels compiled or loaded in this step, this rank
    count = sum(built.values())
    scalars.update(build_metrics(count, run.world))
    if built:
        log.info("step %d built %d Triton kernels: %s", step, count,
                 ", ".join(f"{k} x{v}" for k, v in sorted(built.items())))
        for variant in builds.variants[first_variant:]:  # what a precompile would have to cover
            (log.info if cfg.precompile else log.debug)("step %d built %s", step, variant)
    scalars.update(run.first_scalars)
    run.first_scalars = {}
    if cfg.eval_every and step % cfg.eval_every == 0:
        scalars.update(evaluate(run.engine, run.task, cfg, run.world, step=step))
    return scalars


def save_checkpoint(run: Run, step: int, data_position: int | None) -> Path | None:
    """Checkpoint the policy at `step`. Collective when sharded: every rank gathers, rank 0 writes the one-GPU
    format (so the run resumes on any number of GPUs), and a failed write fails every rank. Replicated state
    (LoRA on several ranks) is first checked to be bitwise the same on every rank; rank 0's write is not cut
    by the PeerWatch. `data_position`: where a dataset's order continues (spirl.loops.prompts.DataCursor), for
    the tasks read in order. With --off-policy-steps, the rollouts sampled ahead go with it (spirl.loops.ahead)."""
    from ..core.distributed import check_replicas

    policy, world, watch = run.policy, run.world, run.progress.watch
    state = {"config": checkpoint_dict(run.cfg), "model_dir": str(run.model.path), "world_size": world.size,
             "reference": run.reference}
    if data_position is not None:
        state["data_position"] = data_position
    masters = {name: world.full_cpu(p) for name, p in policy.masters.items()}
    opt = ckpt.optimizer_tensors(policy.optimizer, world.full_cpu)
    if world.sharded and not policy.fsdp:
        check_replicas({**masters, **opt[0]}, world, "adapters and their optimizer state")
    pending = ahead.gather_pending(run.ahead.pending(), world) if run.cfg.off_policy_steps else None
    extra = _extra_writer(pending, run.partial)
    adapter = None
    if getattr(policy, "spec", None) is not None:  # LoRA: the masters are written as a PEFT adapter
        from ..core.lora import adapter_writer

        adapter = adapter_writer(policy, run.spec, run.reference.get("fingerprint", ""))
    path, error = None, None
    if world.is_main:
        try:
            with watch.local_write() if watch is not None else nullcontext():
                path = ckpt.save(run.checkpoint_root, step, masters, opt, state, adapter, extra)
        except UserError as e:
            error = e
    world.raise_if_any(error)
    if path is not None:
        log.info("checkpoint: %s", path)
    run.progress.saved = step
    return path


def _extra_writer(pending, partial):
    """What a checkpoint holds besides the policy: the rollouts sampled ahead (--off-policy-steps) and the groups
    carried to the next step (--partial-rollout-tokens); None when neither."""
    if pending is None and partial is None:
        return None

    def write(directory):
        if pending is not None:
            ahead.write_pending(directory, *pending)
        if partial is not None:
            partial.write(directory)

    return write


def stop_early(run: Run, when: str) -> None:
    """SIGTERM: the last completed step checkpointed (unless it is already), one line, and the run ends
    normally (exit status 0)."""
    progress = run.progress
    done = progress.done
    if done is not None and progress.saved != done:
        save_checkpoint(run, done, progress.position)  # the data position after that step, not after the rollout
    if done is None and progress.saved is None:
        how = "no step was completed, so there is no checkpoint: start the run again"
    else:
        how = f"continue with --resume {run.checkpoint_root}"
    log.warning("stopped by SIGTERM %s: the last completed step is %s; %s", when,
                done if done is not None else progress.saved, how)


def _on_rank_error(e: BaseException, watch) -> BaseException:
    """Under torchrun: the error to report for `e`, raised on this rank. An error of a collective (a peer
    died inside it) becomes the first failure the PeerWatch knows of; any other is published, so the
    other ranks stop naming it, and reported as it is."""
    import torch.distributed as dist

    from ..core.errors import EXIT_PEER_FAILED, classify, one_line

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
