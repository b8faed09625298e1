"""The GRPO loop: rollouts -> rewards -> advantages -> parity check -> updates -> weight sync.

The policy (weights, compute model, engine, weight sync) is spirl/core/policy.py's (and spirl/core/lora.py's).

Per step, in order (1-4: spirl/loops/rollout.py, in rounds with --dynamic-sampling):
  1. prompts from a python RNG seeded by (seed, step), or a dataset's seeded epoch order from the run's
     checkpointed position; sampling seed derived from (seed, step): a step depends only on the weights,
     the optimizer state, its number (and that position), so a resumed run repeats the uninterrupted one;
  2. the engine samples group_size completions per prompt (token ids + logprobs);
  3. the trainer's packed forward on the sampled ids (no grad) must equal the engine's logprob of
     every sampled token bit for bit (under the distribution --logprobs names), else ParityError
     (report written, no new checkpoint);
  4. rewards, group-relative advantages (--scale-rewards); with --dynamic-sampling, groups of equal
     rewards are dropped and more are sampled; with --vllm-sleep the engine then sleeps (KV cache
     freed, weights in host memory) until the weight sync;
  5. reference-policy logprobs (frozen copy of the initial weights; only when kl_coef > 0);
  6. if every advantage is zero (all groups had equal rewards) there is no learning signal: the
     step is logged with `skipped_update=1` and no optimizer step is taken (nothing to sync);
  7. updates_per_batch optimizer steps, each over one mini-batch split into micro-batches of at
     most max_tokens_per_microbatch tokens, with the loss --loss-type names (spirl/loops/loss.py),
     its normalizers over the whole mini-batch on every rank;
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
import time
from pathlib import Path

import torch

from ..core.config import TrainConfig
from .loss import LossMenu, SequenceWeights, grpo_loss, pad, sequence_weights
from ..core.optim import clip_grad_norm, step_with_deltas
from ..numerics.parity import SamplingDist, logprob_dist, sampled_logprobs, sampled_logprobs_and_entropy
from ..core.policy import Policy, sync_weights
from ..core.spec import PolicySpec
from ..core.distributed import even_slices
from .rollout import DataCursor, Placeholder, PromptSource, Rollout, collect
from .timing import phase_metrics, timed

log = logging.getLogger("spirl.loops.trainer")

class NonFiniteLossError(RuntimeError):
    """The loss became NaN/Inf; the run stops with the last good checkpoint kept."""


def sampling_dist(cfg: TrainConfig) -> SamplingDist:
    """The distribution whose logprobs engine and trainer compare and train on (--logprobs)."""
    return logprob_dist(cfg.logprobs, cfg.temperature, cfg.min_p)


# -- one step -----------------------------------------------------------------------------------------------


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


def minibatch_weights(cfg: TrainConfig, samples, world) -> SequenceWeights:
    """The loss normalizers of one mini-batch (spirl.loops.loss.sequence_weights) over every rank: L_max =
    --max-new-tokens (times --max-turns for multi-turn episodes); truncated = the last turn did not end on its
    own (finish_reason length, or context for an episode)."""
    real = [getattr(s, "seq", s) for s in samples]
    turns = cfg.max_turns if real and hasattr(real[0], "segments") else 1
    return sequence_weights(cfg.loss_type, [len(s.logprobs) for s in samples],
                            [s.finish_reason in ("length", "context") for s in samples], cfg.max_new_tokens * turns,
                            bool(cfg.mask_truncated_completions), [not isinstance(s, Placeholder) for s in samples],
                            world)


def micro_batch_loss(policy: Policy, samples, old_lps, ref_lps, adv, weights: SequenceWeights, cfg: TrainConfig,
                     device) -> tuple[torch.Tensor, dict]:
    """(loss, its metrics) of one micro-batch: the trainer's forward (logprobs and entropy under the run's
    sampling distribution) and the loss --loss-type names, with the mini-batch's normalizers `weights`."""
    lps, ent = sampled_logprobs_and_entropy(policy.model, samples, device, sampling_dist(cfg),
                                            entropy_grad=cfg.entropy_coef > 0)
    lp, mask = pad(lps)
    ref = None if ref_lps is None else pad(ref_lps)[0].to(device)
    return grpo_loss(lp, pad(old_lps)[0].to(device), ref, adv.to(device), mask, cfg.clip_eps, cfg.kl_coef,
                     pad(ent)[0], cfg.entropy_coef, LossMenu.from_config(cfg), weights)


def train_minibatch(policy: Policy, samples, old_lps, ref_lps, adv, cfg: TrainConfig, device, times) -> dict:
    """One optimizer step over `samples`, accumulated over micro-batches of at most
    cfg.max_tokens_per_microbatch tokens. ref_lps is None when there is no KL term. Returns the
    mini-batch's loss metrics and the per-layer weight deltas. FSDP-sharded: every rank runs as many
    forward/backward passes as the rank with the most micro-batches (FSDP's collectives must pair
    up); the extra ones are zero-weight passes over a sequence, which add exact zeros. Several ranks:
    the gradients are averaged over ranks before the optimizer step (`Policy.reduce_grads`)."""
    world = policy.world
    sums: dict[str, float] = {}
    weights = minibatch_weights(cfg, samples, world)  # normalizers over the whole mini-batch, every rank
    slices: list[slice | None] = list(token_budget_slices([len(s.ids) for s in samples], cfg.max_tokens_per_microbatch))
    bad: float | None = None  # this rank's non-finite loss, if it met one
    if policy.fsdp:
        slices += [None] * (int(world.all_max(len(slices))) - len(slices))
    for sl in slices:
        padding = sl is None
        sl = slice(0, 1) if padding else sl
        with timed(times, "forward"):
            loss, m = micro_batch_loss(policy, samples[sl], old_lps[sl], None if ref_lps is None else ref_lps[sl],
                                       adv[sl], weights[sl], cfg, device)
        if not torch.isfinite(loss):
            bad = float(loss.detach())
        if policy.fsdp and world.any(bad is not None):  # every rank is at the same pass: decide now
            _raise_nonfinite(bad)
        if bad is not None:  # replicated model: the ranks decide together after their own passes
            break
        w = 0.0 if padding else 1.0  # each part's loss carries its share of the mini-batch's normalizer
        with timed(times, "backward"):
            (loss * w).backward()
            policy.grads_to_masters()
        if not padding:
            for k, v in {"loss": float(loss.detach()), **m}.items():
                sums[k] = sums.get(k, 0.0) + w * v
    if not policy.fsdp and world.any(bad is not None):
        _raise_nonfinite(bad)
    sums = world.mean_over_ranks(sums)  # each rank's share is scaled by the ranks: their mean is the sum
    with timed(times, "optimizer"):
        policy.reduce_grads()
        if cfg.max_grad_norm > 0:
            clip_grad_norm(list(policy.masters.values()), cfg.max_grad_norm)
        deltas = step_with_deltas(policy.optimizer, world.all_sum if policy.fsdp else None)  # replicas: own sums
        policy.optimizer.zero_grad(set_to_none=True)
    with timed(times, policy.merge_phase):
        policy.push_masters_to_model()
    return {**sums, **deltas}


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


def step_scalars(policy: Policy, ro: Rollout) -> dict:
    """The step's reward, parity and length scalars over every rank (on one process: of its own): rewards,
    parity and completion lengths of every sampled sequence (every round, kept or not), tokens_trained of
    what is trained. Rewards are gathered, so their mean and std are the one-process formulas (unscorable
    samples, NaN, left out)."""
    world = policy.world
    sampled = sum(len(s.logprobs) for s in ro.sampled)
    trained = sum(len(s.logprobs) for s in ro.samples if not isinstance(s, Placeholder))
    compared, different, sampled, count, trained = world.all_sum([ro.report.tokens_compared, ro.report.tokens_different,
                                                                  sampled, len(ro.sampled), trained])
    every = torch.cat(world.gather(ro.sampled_rewards))
    every = every[~torch.isnan(every)]
    out = {"reward_mean": float(every.mean()), "reward_std": float(every.std(unbiased=False)),
           "parity/tokens_compared": compared, "parity/tokens_different": different,
           "parity/max_abs_diff": world.all_max(ro.report.max_abs_diff),
           "completion_len_mean": sampled / count, "tokens_trained": trained}
    if world.sharded:
        for r, (c, d) in enumerate(world.gather((ro.report.tokens_compared, ro.report.tokens_different))):
            out[f"parity/rank{r}/tokens_compared"], out[f"parity/rank{r}/tokens_different"] = float(c), float(d)
    return {**out, **ro.metrics}


def run_step(step: int, cfg: TrainConfig, task, engine, policy: Policy, spec: PolicySpec, device, run_dir: Path,
             source: PromptSource | None = None, stop=None) -> dict | None:
    """One GRPO step of `policy` (built from `spec`); its scalars, with time/<phase> and time/step (the
    whole step's wall clock). `source`: the run's prompts (a dataset's position lives in it); None = a fresh
    one at position 0. `stop()`: asked once after the rollout (every rank together); when it says so, the
    step ends there and returns None, nothing of it applied."""
    times: dict[str, float] = {}
    start = time.perf_counter()
    dist = sampling_dist(cfg)
    world = policy.world
    ro = collect(step, cfg, task, engine, policy, device, run_dir, source or PromptSource(task, cfg.seed, DataCursor()),
                 times)
    samples, adv = ro.samples, ro.advantages
    if stop is not None and stop():
        return None
    multi_turn = getattr(task, "multi_turn", False)
    if multi_turn and cfg.save_rollouts:
        suffix = f"_rank{world.rank}" if world.sharded else ""
        save_rollouts(run_dir / "rollouts" / f"step_{step:06d}{suffix}.jsonl", ro.sampled, ro.sampled_metas, task,
                      ro.sampled_rewards)
    if hasattr(engine, "sleep"):
        engine.sleep()  # free the KV cache while the trainer trains (--vllm-sleep)
    out = step_scalars(policy, ro)
    if multi_turn and cfg.detect_retokenization and samples:
        with torch.no_grad():
            out.update(detect_retokenization(samples, ro.metas, task, policy.model, device))
    if not world.any(bool((adv != 0).any())):
        if world.is_main:  # decided over all ranks: said once
            log.warning("step %d: every group has equal rewards, so every advantage is 0: no update this step", step)
        out["skipped_update"] = 1.0
        times["step"] = time.perf_counter() - start
        return {**out, **phase_metrics(times, world)}
    ref_lps = None
    if policy.has_reference:
        with timed(times, "reference"), torch.no_grad(), policy.reference_model() as ref:
            ref_lps = [x.float().cpu() for x in sampled_logprobs(ref, samples, device, dist)]
    old_lps = [s.logprobs for s in samples]
    slices = even_slices(len(samples), cfg.updates_per_batch)  # the mini-batches
    real = [sum(not isinstance(s, Placeholder) for s in samples[sl]) for sl in slices]
    slices = [sl for sl, n in zip(slices, world.all_sum(real)) if n]  # none anywhere (few kept groups): no update
    agg: dict[str, float] = {}
    for sl in slices:
        mb, mb_old, mb_ref, mb_adv = samples[sl], old_lps[sl], None if ref_lps is None else ref_lps[sl], adv[sl]
        if not mb:  # this rank has no sequence in this mini-batch: a zero-weight stand-in (rollout.Placeholder)
            mb, mb_old, mb_adv = [Placeholder(getattr(samples[0], "seq", samples[0]))], old_lps[:1], torch.zeros(1)
            mb_ref = None if ref_lps is None else ref_lps[:1]
        m = train_minibatch(policy, mb, mb_old, mb_ref, mb_adv, cfg, device, times)
        for k, v in m.items():
            agg[k] = agg.get(k, 0.0) + v / len(slices)
    with timed(times, "weight_sync"):
        sync_weights(engine, policy, spec)
    out.update(agg)
    out["skipped_update"] = 0.0
    times["step"] = time.perf_counter() - start
    return {**out, **phase_metrics(times, world)}
