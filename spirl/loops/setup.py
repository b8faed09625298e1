"""A GRPO run's set-up: `setup(cfg) -> Run`, everything its steps read (the loop: spirl.loops.run).

Cheap checks first (spirl/core/preflight.py), so that a bad set-up fails in one line (spirl.core.errors)
before anything heavy is loaded:
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
     (`TrainConfig.policy_spec`), the engine (which gets the trainer's exact weights), then, with
     --precompile 1, the kernels the steps will need (spirl.loops.precompile), and the logger.
Under torchrun the ranks join first, so that every later check runs on every rank alike, and a PeerWatch
(spirl.core.faults) stops every rank within seconds when one dies or fails.
"""

from __future__ import annotations

import logging
import random
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchtitan_compat.config import ModelDir, is_moe

from ..core import checkpoint as ckpt
from ..core.build import build_policy_and_engine
from ..core.config import TrainConfig, to_dict
from ..core.distributed import World, check_distributed_config, check_distributed_task, init_world, launched_by_torchrun
from ..core.faults import PeerWatch
from ..core.metrics import MetricsLogger
from ..core.policy import Policy, resume_into, sync_weights
from ..core.preflight import (LengthCheckedEngine, check_memory, check_prompt_lengths, check_resume,
                              engine_max_model_len, load_checked_tokenizer, model_fingerprint, resolve_device,
                              resolve_model, validate_model_dir)
from ..core.spec import PolicySpec
from . import ahead
from .filters import load_filters
from .partial import PARTIAL_JSON, PartialState
from . import precompile as warmup
from .evaluation import require_eval_set
from .prompts import DataCursor, PromptSource, ordered
from .signals import Signals

log = logging.getLogger("spirl.loops.setup")

_NATIVE = "; on a machine without vLLM/CUDA use --engine native --dtype float32"


@dataclass
class Progress:
    """How far a run got: what an interrupt's one line and a SIGTERM's last checkpoint need. Made before
    the set-up, so that an error during it is reported too."""

    step: int | None = None
    """The step in progress (None: still setting up)."""
    done: int | None = None
    """The last step whose scalars were logged."""
    saved: int | None = None
    """The step of the last checkpoint this run wrote or resumed from."""
    position: int | None = None
    """The data position after step `done` (ordered tasks; None otherwise)."""
    watch: PeerWatch | None = None
    """Under torchrun: the watch over the other ranks (spirl.core.faults)."""


@dataclass
class Run:
    """A GRPO run between set-up and teardown: what its steps read and write (spirl.loops.trainer.run_step,
    spirl.loops.rollout.collect). A context manager: its exit closes what the set-up opened, last first."""

    cfg: TrainConfig
    world: World
    device: torch.device
    model: ModelDir
    """The checkpoint the run started from, its config.json read once."""
    reference: dict
    """The model as named, its directory and fingerprint: what every checkpoint records as the run's start."""
    task: object
    source: PromptSource
    """The step's prompts; for an ordered task its cursor is the data position checkpoints record."""
    spec: PolicySpec
    policy: Policy
    engine: object
    run_dir: Path
    """Where the logs go: <out-dir>/<run-name>."""
    start: int
    """The last step done before this process (0 for a fresh run; the resumed checkpoint's step)."""
    signals: Signals
    progress: Progress
    builds: warmup.TritonBuilds | None = None
    """Counts the Triton kernels each step builds."""
    logger: object = None
    """spirl.core.metrics.MetricsLogger on rank 0; a logger of nothing on the other ranks."""
    ahead: object = None
    """The rollouts sampled and not yet trained on (spirl.loops.ahead.Ahead; with --off-policy-steps, a
    checkpoint's)."""
    partial: object = None
    """--partial-rollout-tokens: the groups carried to the next step (spirl.loops.partial.PartialState)."""
    begun: object = None
    """A later step's rollout begun at the end of this one (spirl.loops.trainer.Following;
    TrainConfig.checks_after_update), None otherwise."""
    filters: list = field(default_factory=list)
    """--dynamic-sampling's and --filter's group filters (spirl.loops.filters), in order; empty: every group kept."""
    first_scalars: dict = field(default_factory=dict)
    """Scalars logged with the first step (what --precompile built)."""
    closing: ExitStack = field(default_factory=ExitStack)

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.cfg.checkpoint_dir) / self.cfg.run_name

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.closing.close()  # the logger, the Triton build counter, one process's engine
        if exc_type is None and self.world.sharded:  # every rank done before the shared process group goes
            self.progress.watch.done()  # a rank that ends first is no failure (train() closes the watch)
            self.world.barrier()
            self.engine.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def setup(cfg: TrainConfig, signals: Signals | None = None, progress: Progress | None = None) -> Run:
    """The run `cfg` describes, set up in the module docstring's order. `signals`: the handlers installed
    (spirl.loops.signals; default: none installed); `progress`: where an error during set-up finds the
    watch of the ranks."""
    signals = signals or Signals()
    progress = progress or Progress()
    _seed_and_warn(cfg)
    run_dir = _check_environment(cfg)
    world = _join_ranks(cfg, signals, progress)
    model, reference = _checkpoint(cfg, world)
    _check_model_options(cfg, model.args)
    lora = resumed = None
    if cfg.lora:  # the adapter's spec (rank checked against the layers, --lora-init read) before anything heavy
        from ..core.lora import resolve_spec

        lora = resolve_spec(cfg, model.args, model.path, reference["fingerprint"])
    if cfg.resume:
        resumed = check_resume(cfg.resume, model.args, reference, None if lora is None else lora.spec)
    if cfg.engine == "vllm":
        from ..core.errors import require_cuda

        require_cuda("--engine vllm", _NATIVE)
    device = world.device if world is not None else resolve_device(cfg.device)
    world = world or World(device=device)
    task, source, filters = _task(cfg, model, world, resumed)
    limit, why = engine_max_model_len(cfg, model.args)
    longest = check_prompt_lengths(task, cfg, limit, why)  # None: prompts not known up front
    if device.type == "cuda":
        single_turn = longest is not None and not getattr(task, "multi_turn", False)
        check_memory(cfg, model.args, device, longest + cfg.max_new_tokens if single_turn else limit,
                     world.size if world.sharded and lora is None else 0, None if lora is None else lora.spec)
    spec = cfg.policy_spec(lora)
    policy, engine = build_policy_and_engine(model, spec, device, world)
    run = Run(cfg, world, device, model, reference, task, source, spec, policy, engine, run_dir, 0, signals, progress,
              filters=filters)
    if not world.sharded:  # several ranks close their engines together, after the last step (Run.__exit__)
        run.closing.callback(engine.close)  # frees the GPU and ends vLLM's torch.distributed world: a clean exit
    try:
        _start_policy(run, limit, why, longest, resumed)
        _start_logging(run)
    except BaseException:
        run.closing.close()  # what was opened is closed at once when the rest of the set-up fails
        raise
    return run


def _check_model_options(cfg: TrainConfig, args) -> None:
    """Options that only some models can take, refused in one line."""
    from ..core.config import ConfigError

    moe = is_moe(args)
    if cfg.router_aux_loss and not moe:
        raise ConfigError("--router-aux-loss 1 needs a mixture-of-experts model (model_type qwen3_moe); this one "
                          "is dense")
    if moe and cfg.engine == "vllm" and cfg.min_p > 0:
        raise ConfigError("--min-p with a Qwen3-MoE model: vLLM samples it with its V1 sampler, whose min-p the "
                          "trainer does not reproduce; use --min-p 0")


def _seed_and_warn(cfg: TrainConfig) -> None:
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.top_k != -1 or cfg.top_p != 1.0:
        log.warning("--top-k/--top-p truncate the sampling distribution, but the trainer's logprobs are of the raw "
                    "logits (--logprobs raw): the trained policy is not the one that sampled (off-policy)")
    if cfg.importance_sampling_level == "sequence" and cfg.loss_type != "grpo":
        log.warning("--importance-sampling-level sequence with --loss-type %s sums per-token losses of a per-sequence "
                    "ratio; GSPO's paper (and TRL's advice) pairs it with --loss-type grpo", cfg.loss_type)


def _check_environment(cfg: TrainConfig) -> Path:
    """The output directories writable and, for --engine vllm, vLLM usable; returns the run's log directory."""
    from ..core.errors import require_batch_invariant, require_vllm, require_writable_dir

    run_dir = Path(cfg.out_dir) / cfg.run_name
    require_writable_dir(run_dir, "--out-dir")
    require_writable_dir(Path(cfg.checkpoint_dir) / cfg.run_name, "--checkpoint-dir")
    if cfg.engine == "vllm":
        require_batch_invariant(_NATIVE)
        require_vllm(_NATIVE)
    return run_dir


def _join_ranks(cfg: TrainConfig, signals: Signals, progress: Progress) -> World | None:
    """Under torchrun: this rank's World, its PeerWatch started (progress.watch) and the config checked
    against the ranks; None for one process."""
    if not launched_by_torchrun():
        return None
    world = init_world(resolve_device(cfg.device))
    progress.watch = PeerWatch(world.rank, dict(enumerate(world.gather(PeerWatch.identity())))).start()
    progress.watch.stopping = lambda: signals.stop_requested_at
    check_distributed_config(cfg, world)
    return world


def _checkpoint(cfg: TrainConfig, world: World | None) -> tuple[ModelDir, dict]:
    """The model resolved (rank 0 writes a random:<shape> checkpoint once, the others wait) and validated,
    and the reference every checkpoint of the run records."""
    if world is not None and not world.is_main:
        world.barrier()
    model_dir = resolve_model(cfg.model, cfg.checkpoint_dir)
    if world is not None and world.is_main:
        world.barrier()
    model = ModelDir(model_dir, *validate_model_dir(model_dir))  # config.json read and checked here, once
    return model, {"model": cfg.model, "model_dir": str(model_dir), "fingerprint": model_fingerprint(model_dir)}


def _task(cfg: TrainConfig, model: ModelDir, world: World, resumed) -> tuple[object, PromptSource, list]:
    """The task (a --dataset or a --task), its prompt source at the resumed data position and the group filters
    (--filter, --dynamic-sampling); its eval set and its fit to the ranks checked."""
    tokenizer = load_checked_tokenizer(model.path)
    if cfg.dataset:
        from ..tasks import dataset

        task = dataset.make(tokenizer, cfg)
    else:
        from ..tasks import get_task

        task = get_task(cfg.task, tokenizer, cfg)
    source = PromptSource(task, cfg.seed, DataCursor(_data_position(resumed, task)))
    require_eval_set(task, cfg)
    check_distributed_task(task, cfg, world)
    filters = load_filters(cfg, tokenizer, bool(getattr(task, "multi_turn", False)))
    if cfg.partial_rollout_tokens and getattr(task, "multi_turn", False):
        from ..core.config import ConfigError

        raise ConfigError(f"--partial-rollout-tokens with the multi-turn task {cfg.task}: an episode's turns are "
                          "not carried across steps; set --partial-rollout-tokens 0")
    if cfg.generation_gpus:
        _check_generation_gpus(cfg, task)
    return task, source, filters


def _check_generation_gpus(cfg, task) -> None:
    """--generation-gpus M: one engine GPU per trainer rank of the node, single-turn tasks."""
    import os

    from ..core.config import ConfigError

    if getattr(task, "multi_turn", False):
        raise ConfigError(f"--generation-gpus with the multi-turn task {cfg.task} (its episodes rescore in place) "
                          "is not supported; set --generation-gpus 0")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cfg.generation_gpus != local:
        raise ConfigError(f"--generation-gpus {cfg.generation_gpus} with {local} trainer rank(s) on this node: each "
                          f"trainer rank gets one engine GPU, so set --generation-gpus {local}")


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


def _start_policy(run: Run, limit: int, why: str, longest: int | None, resumed: ckpt.CheckpointInfo | None) -> None:
    """The resumed state loaded (`resumed`: check_resume's reading of --resume), prompts of unknown length checked
    per call, and the engine given the trainer's exact weights (which matters on resume)."""
    cfg = run.cfg
    pending = []
    if cfg.resume:
        run.start = resume_into(run.policy, cfg.resume, run.device)
        run.progress.saved = run.start
        pending = _pending_rollouts(cfg, resumed, run.world)
    run.ahead = ahead.Ahead(cfg.off_policy_steps, pending)
    run.partial = _carried(cfg, resumed) if cfg.resume else PartialState() if cfg.partial_rollout_tokens else None
    if longest is None:
        run.engine = LengthCheckedEngine(run.engine, cfg, limit, why)
    sync_weights(run.engine, run.policy, run.spec)


def _pending_rollouts(cfg: TrainConfig, resumed: ckpt.CheckpointInfo, world: World) -> list:
    """The rollouts the --resume checkpoint sampled ahead (--off-policy-steps), refused in one line when that run
    used another K (its rollouts follow that schedule)."""
    d = _resumed_files(cfg, resumed, "off_policy_steps", "the rollouts it sampled ahead follow that schedule",
                       ahead.ROLLOUTS_JSON, "the rollouts sampled ahead", "an --off-policy-steps run")
    return [] if d is None else ahead.read_pending(d, world, cfg.group_size)


def _carried(cfg: TrainConfig, resumed: ckpt.CheckpointInfo) -> PartialState | None:
    """The groups the --resume checkpoint carried (--partial-rollout-tokens), refused in one line when that run
    used another budget (what it carried was cut by it)."""
    d = _resumed_files(cfg, resumed, "partial_rollout_tokens", "what it carried was cut by that budget", PARTIAL_JSON,
                       "the groups carried to the next step", "a --partial-rollout-tokens run")
    return None if d is None else PartialState.read(d)


def _resumed_files(cfg: TrainConfig, resumed: ckpt.CheckpointInfo, field: str, why: str, name: str, what: str,
                   run: str) -> Path | None:
    """The --resume checkpoint's directory, to read the file `name` (`what`) a run with the setting `field` wrote
    into it; None when this run's `field` is 0. Refused in one line when the checkpoint's run had another `field`
    (`why` it must be the same) or the file is missing (a checkpoint of `run` holds it)."""
    d, flag = resumed.path, "--" + field.replace("_", "-")
    then = resumed.state.get("config", {}).get(field, 0)
    if then != getattr(cfg, field):
        raise ckpt.CheckpointError(f"--resume {d} was written by a run with {flag} {then}; resume with {flag} {then} "
                                   f"({why})")
    if not then:
        return None
    if not (d / name).is_file():
        raise ckpt.CheckpointError(f"--resume {d} holds no {name} ({what}); pass a checkpoint written whole by {run}")
    return d


def _start_logging(run: Run) -> None:
    """Count Triton builds from here on (after the engine is built: vLLM installs its JIT monitor in its
    warm-up), precompile with --precompile 1, and open the logger (rank 0)."""
    cfg = run.cfg
    run.builds = run.closing.enter_context(warmup.TritonBuilds())
    if warmup.wanted(cfg, run.device):
        run.first_scalars = warmup.precompile(run.engine, run.policy, cfg, run.device, run.model.args, run.builds)
    if run.world.is_main:
        run.logger = MetricsLogger(run.run_dir, {"args": to_dict(cfg), "seed": cfg.seed, "model_dir": str(run.model.path),
                                                 "device": str(run.device), "world_size": run.world.size,
                                                 "reference": run.reference},
                                   resume_step=run.start if cfg.resume else None)
    else:
        run.logger = _NoLogger()
    run.closing.callback(run.logger.close)


class _NoLogger:
    """Ranks other than 0 log nothing (rank 0 logs the reduced scalars of every rank)."""

    def log_step(self, *args) -> None:
        pass

    def close(self) -> None:
        pass
