"""One GRPO run: setup, the step loop, checkpoints and resume (the step itself: spirl/trainer.py).

Setup order: the config is validated (spirl.config), the model resolved (a local directory, a Hub
repo id, or `random:<shape>`), the task and tokenizer, the policy (fp32 masters, compute model,
reference), the engine (which gets the trainer's exact weights), then steps. Metrics: one
TensorBoard scalar set and one metrics.jsonl line per step (spirl.metrics); checkpoints every
`checkpoint_every` steps and after the last (spirl.checkpoint).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import trainer
from .config import TrainConfig, to_dict
from .evaluation import evaluate
from .metrics import MetricsLogger
from .trainer import Policy

log = logging.getLogger("spirl.run")


class ModelError(ValueError):
    """--model is unusable; one line saying what to do."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_model(model: str, checkpoint_dir: str) -> Path:
    """A local dir, an HF repo id (downloaded), or `random:<shape>` (written once, deterministic)."""
    import weights

    if model.startswith("random:"):
        shape = model.split(":", 1)[1]
        out = Path(checkpoint_dir) / "models" / f"random-{shape}"
        if not (out / "config.json").is_file():
            try:
                weights.write_random_checkpoint(out, shape, seed=0, dtype=torch.float32, overwrite=True)
            except weights.WeightsError as e:
                raise ModelError(f"--model {model}: {e}") from None
        return out
    try:
        return weights.resolve_model_dir(model)
    except weights.WeightsError as e:
        raise ModelError(f"--model: {e}") from None


def save_checkpoint(cfg: TrainConfig, policy: Policy, step: int, model_dir: Path) -> Path:
    state = {"config": to_dict(cfg), "model_dir": str(model_dir)}
    path = ckpt.save(Path(cfg.checkpoint_dir) / cfg.run_name, step, policy.masters, policy.optimizer, state)
    log.info("checkpoint: %s", path)
    return path


def resume_into(policy: Policy, path: str, device) -> int:
    state, masters, opt_state = ckpt.load(path, device)
    with torch.no_grad():
        for name, p in policy.masters.items():
            p.copy_(masters[name])
    policy.optimizer.load_state_dict(opt_state)
    policy.push_masters_to_model()
    ckpt.restore_rng(state)
    log.info("resumed from %s at step %d", ckpt.resolve(path), state["step"])
    return int(state["step"])


def train(cfg: TrainConfig) -> list[dict]:
    """Run cfg.steps GRPO steps; returns the per-step metrics (also logged)."""
    from torchtitan_compat.tokenizer import load_tokenizer

    from .tasks import get_task

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    model_dir = resolve_model(cfg.model, cfg.checkpoint_dir)
    task = get_task(cfg.task, load_tokenizer(model_dir))
    policy = trainer.build_policy(model_dir, cfg, device)
    start = resume_into(policy, cfg.resume, device) if cfg.resume else 0
    engine = trainer.build_engine(cfg, model_dir, policy)
    trainer.sync_weights(engine, policy, cfg)  # the engine starts from the trainer's exact weights (matters on resume)
    run_dir = Path(cfg.out_dir) / cfg.run_name
    logger = MetricsLogger(run_dir, {"args": to_dict(cfg), "seed": cfg.seed, "model_dir": str(model_dir),
                                     "device": str(device)})
    history = []
    try:
        if cfg.eval_every and start == 0:  # the baseline: one eval before the first step
            logger.log_step(0, evaluate(engine, task, cfg), cfg.steps)
        for step in range(start + 1, cfg.steps + 1):
            scalars = trainer.run_step(step, cfg, task, engine, policy, device, run_dir)
            if cfg.eval_every and step % cfg.eval_every == 0:
                scalars.update(evaluate(engine, task, cfg))
            logger.log_step(step, scalars, cfg.steps)
            history.append(scalars)
            if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                save_checkpoint(cfg, policy, step, model_dir)
    finally:
        logger.close()
    return history
