"""The GRPO loop: rollouts -> rewards -> advantages -> parity check -> updates -> weight sync.

The policy (weights, compute model, engine, weight sync) is spirl/core/policy.py's (and spirl/core/lora.py's).

Per step, in order:
  1. prompts from a python RNG seeded by (seed, step), sampling seed derived from (seed, step):
     a step depends only on the weights, the optimizer state and its number, so a resumed run
     repeats the uninterrupted one exactly;
  2. the engine samples group_size completions per prompt (token ids + logprobs);
  3. rewards, group-relative advantages;
  4. the trainer's packed forward on the sampled ids (no grad) must equal the engine's logprob of
     every sampled token bit for bit (under the distribution --logprobs names), else ParityError
     (report written, no new checkpoint); with --vllm-sleep the engine then sleeps (KV cache
     freed, weights in host memory) until the weight sync;
  5. reference-policy logprobs (frozen copy of the initial weights; only when kl_coef > 0);
  6. if every advantage is zero (all groups had equal rewards) there is no learning signal: the
     step is logged with `skipped_update=1` and no optimizer step is taken (nothing to sync);
  7. updates_per_batch optimizer steps, each over one mini-batch split into micro-batches of at
     most max_tokens_per_microbatch tokens;
     a NaN/Inf loss stops the run before any gradient of it is applied (NonFiniteLossError);
  8. weight sync to the engine; metrics; checkpoint every checkpoint_every steps and at the end.

Memory: fp32 masters + AdamW state + fp32 grads, the bf16 compute model (+ its transient bf16
grads), a bf16 reference only when kl_coef > 0, activations of one micro-batch (per decoder layer
only its input with activation checkpointing), lm_head in row chunks (never [T, vocab] at once),
and the engine's share. `memory/peak_gib/<phase>` reports torch's peak allocation per phase.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..core.config import TrainConfig
from ..core.distributed import World, shard_of
from .loss import grpo_advantages, grpo_loss, pad
from ..core.multiturn import episode_metrics, run_episodes
from ..core.optim import clip_grad_norm, step_with_deltas
from ..numerics.parity import (
    ParityReport,
    SamplingDist,
    check_parity,
    logprob_dist,
    sampled_logprobs,
    sampled_logprobs_and_entropy,
)
from ..core.policy import Policy, sync_weights
from ..core.spec import PolicySpec

log = logging.getLogger("spirl.loops.trainer")

class NonFiniteLossError(RuntimeError):
    """The loss became NaN/Inf; the run stops with the last good checkpoint kept."""


def sampling_dist(cfg: TrainConfig) -> SamplingDist:
    """The distribution whose logprobs engine and trainer compare and train on (--logprobs)."""
    return logprob_dist(cfg.logprobs, cfg.temperature, cfg.min_p)


# -- one step -----------------------------------------------------------------------------------


@contextmanager
def timed(times: dict, key: str):
    """Adds the phase's seconds to times[key] and, on a GPU, its peak torch allocation (GiB) to
    times["peak:" + key] (the max over the phase's repetitions)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
        times["peak:" + key] = max(times.get("peak:" + key, 0.0), peak)
    times[key] = times.get(key, 0.0) + time.perf_counter() - t0


def phase_metrics(times: dict, world: World | None = None) -> dict[str, float]:
    """time/<phase> seconds and memory/peak_gib/<phase> from what `timed` collected; on several ranks
    (collective) the peak is the busiest GPU's, the times this rank's."""
    if world is not None and world.sharded:
        peaks = world.gather({k: v for k, v in times.items() if k.startswith("peak:")})
        times = {**times, **{k: max(p.get(k, 0.0) for p in peaks) for k in peaks[0]}}
    out = {}
    for k, v in times.items():
        out[f"memory/peak_gib/{k[5:]}" if k.startswith("peak:") else f"time/{k}"] = v
    return out


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**63)


def token_budget_slices(lengths: list[int], budget: int) -> list[slice]:
    """Consecutive micro-batches of whole sequences, each at most `budget` tokens (a longer
    sequence gets one of its own). The split depends only on the lengths, so it is reproducible."""
    slices, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n > budget:
            slices.append(slice(start, i))
            start, used = i, 0
        used += n
    slices.append(slice(start, len(lengths)))
    return slices


def _raise_nonfinite(value: float | None):
    what = f"loss is {value}" if value is not None else "the loss is not finite on another rank"
    raise NonFiniteLossError(f"{what}; stopping before its gradient is applied (the last checkpoint is kept)")


def train_minibatch(policy: Policy, samples, old_lps, ref_lps, adv, cfg: TrainConfig, device, times) -> dict:
    """One optimizer step over `samples`, accumulated over micro-batches of at most
    cfg.max_tokens_per_microbatch tokens. ref_lps is None when there is no KL term. Returns the
    mini-batch's loss metrics and the per-layer weight deltas. FSDP-sharded: every rank runs as many
    forward/backward passes as the rank with the most micro-batches (FSDP's collectives must pair
    up); the extra ones are zero-weight passes over a sequence, which add exact zeros. Several ranks:
    the gradients are averaged over ranks before the optimizer step (`Policy.reduce_grads`)."""
    n = len(samples)
    world = policy.world
    sums: dict[str, float] = {}
    dist = sampling_dist(cfg)
    slices: list[slice | None] = list(token_budget_slices([len(s.ids) for s in samples], cfg.max_tokens_per_microbatch))
    if policy.fsdp:
        slices += [None] * (int(world.all_max(len(slices))) - len(slices))
    for sl in slices:
        padding = sl is None
        sl = slice(0, 1) if padding else sl
        with timed(times, "forward"):
            lps, ent = sampled_logprobs_and_entropy(policy.model, samples[sl], device, dist,
                                                    entropy_grad=cfg.entropy_coef > 0)
            lp, mask = pad(lps)
            ref = None if ref_lps is None else pad(ref_lps[sl])[0].to(device)
            loss, m = grpo_loss(lp, pad(old_lps[sl])[0].to(device), ref, adv[sl].to(device), mask,
                                cfg.clip_eps, cfg.kl_coef, pad(ent)[0], cfg.entropy_coef)
        finite = bool(torch.isfinite(loss))
        if not finite:
            nonfinite = float(loss.detach())
        if policy.fsdp and world.any(not finite):  # every rank is at the same pass: decide now
            _raise_nonfinite(nonfinite if not finite else None)
        if not finite:  # replicated model: the ranks decide together after their own passes
            break
        w = 0.0 if padding else (sl.stop - sl.start) / n  # per-sequence means, weighted: the mini-batch mean
        with timed(times, "backward"):
            (loss * w).backward()
            policy.grads_to_masters()
        if not padding:
            for k, v in {"loss": float(loss.detach()), **m}.items():
                sums[k] = sums.get(k, 0.0) + w * v
    if not policy.fsdp and world.any(not finite):
        _raise_nonfinite(nonfinite if not finite else None)
    sums = world.mean_over_ranks(sums)  # every rank holds the same number of sequences
    with timed(times, "optimizer"):
        policy.reduce_grads()
        if cfg.max_grad_norm > 0:
            clip_grad_norm(list(policy.masters.values()), cfg.max_grad_norm)
        deltas = step_with_deltas(policy.optimizer, world.all_sum if policy.fsdp else None)  # replicas: own sums
        policy.optimizer.zero_grad(set_to_none=True)
    with timed(times, policy.merge_phase):
        policy.push_masters_to_model()
    return {**sums, **deltas}


def extra_sampling(cfg: TrainConfig) -> dict:
    """The engine's sampling settings besides the temperature."""
    return dict(min_p=cfg.min_p, top_k=cfg.top_k, top_p=cfg.top_p)


def collect(step: int, cfg: TrainConfig, task, engine, world: World | None = None
            ) -> tuple[list, list[dict], torch.Tensor, dict]:
    """(trainable sequences, their prompts' metadata, rewards [N], extra metrics) of one step,
    prompt-major: single-turn Samples, or multi-turn Trajectories when the task is an environment.
    On several ranks: this rank's share of the step's prompts, each sampled with the seed one
    process gives it (so the ranks together draw what one process draws)."""
    rng = random.Random(step_seed(cfg.seed, step))
    prompts = shard_of(task.prompts(rng, cfg.prompts_per_step), world or World())
    seed = step_seed(cfg.seed, step) % (2**31)
    if getattr(task, "multi_turn", False):
        trajs, metas = run_episodes(engine, task, prompts, cfg.group_size, cfg.max_turns, cfg.max_new_tokens,
                                    cfg.temperature, seed, max_len=cfg.max_model_len, **extra_sampling(cfg))
        rewards = [task.reward(t, m) for t, m in zip(trajs, metas)]
        return trajs, metas, torch.tensor(rewards, dtype=torch.float32), episode_metrics(trajs)
    samples = engine.generate([p for p, _ in prompts], n=cfg.group_size, max_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, seed=[seed] * len(prompts), **extra_sampling(cfg))
    metas = [meta for _, meta in prompts for _ in range(cfg.group_size)]
    rewards = [task.reward(s.completion_ids, m) for s, m in zip(samples, metas)]
    return samples, metas, torch.tensor(rewards, dtype=torch.float32), {}


def save_rollouts(path: Path, trajs, metas: list[dict], task, rewards: torch.Tensor) -> None:
    """One JSON line per trajectory: the ids, masks and logprobs trained on, and the prompt messages
    (what compare/retokenization.py needs to rebuild the naive text pipeline's sequence).
    Written to a temporary file and renamed, so a file is never half-written."""
    lines = [json.dumps({"trajectory": t.to_json(), "messages": m["messages"], "tools": task.format.tools,
                         "reward": float(r)}) for t, m, r in zip(trajs, metas, rewards)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def detect_retokenization(trajs, metas: list[dict], task, model, device) -> dict:
    """retok/* metrics: compare/retokenization.py's detector on this step's trajectories."""
    from .retokenization import detect

    summary, _ = detect(trajs, [m["messages"] for m in metas], task.format, model, device)
    return summary.metrics()


def step_scalars(policy: Policy, samples, rewards: torch.Tensor, report: ParityReport, extra: dict) -> dict:
    """The step's reward, parity and length scalars over every rank's samples (on one process:
    of its own). Rewards are gathered, so their mean and std are the one-process formulas."""
    world = policy.world
    trained = sum(len(s.logprobs) for s in samples)
    compared, different, trained, count = world.all_sum([report.tokens_compared, report.tokens_different, trained,
                                                         len(samples)])
    every = torch.tensor([r for part in world.gather(rewards.tolist()) for r in part], dtype=torch.float32)
    out = {"reward_mean": float(every.mean()), "reward_std": float(every.std(unbiased=False)),
           "parity/tokens_compared": compared, "parity/tokens_different": different,
           "parity/max_abs_diff": world.all_max(report.max_abs_diff),
           "completion_len_mean": trained / count, "tokens_trained": trained}
    if world.sharded:
        for r, (c, d) in enumerate(world.gather((report.tokens_compared, report.tokens_different))):
            out[f"parity/rank{r}/tokens_compared"], out[f"parity/rank{r}/tokens_different"] = float(c), float(d)
    return {**out, **world.mean_over_ranks(extra)}


def run_step(step: int, cfg: TrainConfig, task, engine, policy: Policy, spec: PolicySpec, device, run_dir: Path,
             stop=None) -> dict | None:
    """One GRPO step of `policy` (built from `spec`); its scalars, with time/<phase> and time/step (the
    whole step's wall clock). `stop()`: asked once after the rollout (every rank together); when it says
    so, the step ends there and returns None, nothing of it applied."""
    times: dict[str, float] = {}
    start = time.perf_counter()
    dist = sampling_dist(cfg)
    world = policy.world
    with timed(times, "rollout"):
        samples, metas, rewards, extra = collect(step, cfg, task, engine, world)
    if stop is not None and stop():
        return None
    adv = grpo_advantages(rewards, cfg.group_size)
    multi_turn = getattr(task, "multi_turn", False)
    if multi_turn and cfg.save_rollouts:
        suffix = f"_rank{world.rank}" if world.sharded else ""
        save_rollouts(run_dir / "rollouts" / f"step_{step:06d}{suffix}.jsonl", samples, metas, task, rewards)
    with timed(times, "parity"), torch.no_grad():
        trainer_lps = sampled_logprobs(policy.model, samples, device, dist)
        report = check_parity(samples, trainer_lps, step, run_dir, engine, policy)
        del trainer_lps
    if hasattr(engine, "sleep"):
        engine.sleep()  # free the KV cache while the trainer trains (--vllm-sleep)
    ref_lps = None
    if policy.has_reference:
        with timed(times, "reference"), torch.no_grad(), policy.reference_model() as ref:
            ref_lps = [x.float().cpu() for x in sampled_logprobs(ref, samples, device, dist)]
    old_lps = [s.logprobs for s in samples]
    out = step_scalars(policy, samples, rewards, report, extra)
    if multi_turn and cfg.detect_retokenization:
        with torch.no_grad():
            out.update(detect_retokenization(samples, metas, task, policy.model, device))
    if not world.any(bool((adv != 0).any())):
        if world.is_main:  # decided over all ranks: said once
            log.warning("step %d: every group has equal rewards, so every advantage is 0: no update this step", step)
        out["skipped_update"] = 1.0
        times["step"] = time.perf_counter() - start
        return {**out, **phase_metrics(times, world)}
    per = len(samples) // cfg.updates_per_batch
    agg: dict[str, float] = {}
    for u in range(cfg.updates_per_batch):
        sl = slice(u * per, (u + 1) * per)
        m = train_minibatch(policy, samples[sl], old_lps[sl], None if ref_lps is None else ref_lps[sl],
                            adv[sl], cfg, device, times)
        for k, v in m.items():
            agg[k] = agg.get(k, 0.0) + v / cfg.updates_per_batch
    with timed(times, "weight_sync"):
        sync_weights(engine, policy, spec)
    out.update(agg)
    out["skipped_update"] = 0.0
    times["step"] = time.perf_counter() - start
    return {**out, **phase_metrics(times, world)}
