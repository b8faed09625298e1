"""The GRPO loop: rollouts -> rewards -> advantages -> parity check -> updates -> weight sync.

Weights: AdamW updates fp32 *master* weights; the trainer's forward runs a compute-dtype model
whose parameters are the cast of the masters (copied after every optimizer step). Gradients flow
into the compute model and are accumulated into the masters' .grad in fp32. The engine receives
the compute model's tensors, i.e. exactly the numbers the trainer's forward uses.

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

import copy
import json
import logging
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import TrainConfig
from .distributed import World, gathered_weight_groups, shard_model, shard_of
from .engines.base import Sample
from .loss import grpo_advantages, grpo_loss, pad
from .multiturn import episode_metrics, run_episodes
from .optim import build_adamw, clip_grad_norm, step_with_deltas
from .parity import (
    ParityReport,
    SamplingDist,
    compare_logprobs,
    logprob_dist,
    sampled_logprobs,
    sampled_logprobs_and_entropy,
)

log = logging.getLogger("spirl.trainer")

EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|> (Qwen3's generation_config eos_token_id)


class ParityError(RuntimeError):
    """The engine's and the trainer's logprob of some sampled token differ."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/Inf; the run stops with the last good checkpoint kept."""


# -- setup ------------------------------------------------------------------------------------


@dataclass
class Policy:
    """fp32 masters (what AdamW updates), the compute model (their cast), the frozen reference
    (None when the loss has no KL term). Sharded (`world.sharded`, under torchrun): `model` is the
    FSDP2 module whose parameters *are* the masters, computing in the compute dtype (see
    spirl.distributed), so there is nothing to push or accumulate by hand."""

    masters: dict[str, torch.nn.Parameter]
    model: torch.nn.Module
    ref: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    world: World = field(default_factory=World)
    compute_dtype: torch.dtype = torch.float32

    @torch.no_grad()
    def push_masters_to_model(self) -> None:
        if self.world.sharded:  # FSDP casts the masters at every all-gather
            return
        for name, p in self.model.named_parameters():
            p.copy_(self.masters[name])  # cast to the compute dtype

    def grads_to_masters(self) -> None:
        """Accumulate the compute model's grads into the masters' fp32 .grad, then clear them
        (sharded: FSDP has reduce-scattered them into the masters' .grad already)."""
        if self.world.sharded:
            return
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            m = self.masters[name]
            g = p.grad.to(torch.float32)
            m.grad = g.clone() if m.grad is None else m.grad.add_(g)
            p.grad = None


def build_policy(model_dir: Path, cfg: TrainConfig, device: torch.device, world: World | None = None) -> Policy:
    from weights_vllm_compat import load_model

    world = world or World(device=device)
    dtype = getattr(torch, cfg.dtype)
    backend = "reference" if cfg.engine == "native" else "auto"
    if world.sharded:
        return _build_sharded_policy(model_dir, cfg, device, world, dtype, backend)
    master_model = load_model(model_dir, device=device, dtype=torch.float32, backend=backend)
    # deepcopy first: .to() of a float32 model to float32 would otherwise share the masters' storage
    model = copy.deepcopy(master_model).to(dtype)
    model.activation_checkpointing = bool(cfg.activation_checkpointing)
    ref = copy.deepcopy(model).requires_grad_(False) if cfg.kl_coef > 0 else None
    masters = dict(master_model.named_parameters())
    return Policy(masters, model, ref, build_adamw(masters, cfg.lr, cfg.weight_decay), world, dtype)


def _build_sharded_policy(model_dir, cfg, device, world: World, dtype, backend) -> Policy:
    """Each rank reads the checkpoint on its CPU; fully_shard moves each layer's shard to its GPU."""
    from weights_vllm_compat import load_model

    from torchtitan_compat import select_backend

    model = load_model(model_dir, device="cpu", dtype=torch.float32, backend=backend)
    model.backend = select_backend(backend, device)  # the GPU's kernels, not the CPU's
    model.activation_checkpointing = bool(cfg.activation_checkpointing)
    ref = None
    if cfg.kl_coef > 0:
        ref = shard_model(copy.deepcopy(model).to(dtype).requires_grad_(False), world, dtype)
    model = shard_model(model, world, dtype)
    masters = dict(model.named_parameters())
    return Policy(masters, model, ref, build_adamw(masters, cfg.lr, cfg.weight_decay), world, dtype)


def sampling_dist(cfg: TrainConfig) -> SamplingDist:
    """The distribution whose logprobs engine and trainer compare and train on (--logprobs)."""
    return logprob_dist(cfg.logprobs, cfg.temperature, cfg.min_p)


def build_engine(cfg: TrainConfig, model_dir: Path, policy: Policy):
    if cfg.engine == "native":
        from .engines.native_engine import NativeEngine

        model = policy.model
        if policy.world.sharded:  # the engine decodes on its own whole copy (weights synced into it)
            from weights_vllm_compat import load_model

            model = load_model(model_dir, device=policy.world.device, dtype=policy.compute_dtype,
                               backend="reference").requires_grad_(False)
        return NativeEngine(model, EOS_IDS, logprobs=cfg.logprobs)
    from .engines.vllm_engine import VLLM_LOGPROBS_MODE, VLLMEngine, VLLMEngineConfig

    return VLLMEngine(VLLMEngineConfig(
        str(model_dir), seed=cfg.seed, gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_model_len=cfg.max_model_len, cuda_graphs="none" if cfg.eager else "full_decode_only",
        logprobs_mode=VLLM_LOGPROBS_MODE[cfg.logprobs],
        sleep_between_rollouts=bool(cfg.vllm_sleep), external_launcher=policy.world.sharded))


def sync_weights(engine, policy: Policy, cfg: TrainConfig) -> None:
    """Load the compute model's tensors (the trainer's exact forward weights) into the engine;
    sharded: gathered whole one layer at a time, on every rank, into that rank's engine."""
    import weights_vllm_compat

    if policy.world.sharded:
        groups = gathered_weight_groups(policy.model, policy.compute_dtype)
    else:
        groups = [{k: v.detach() for k, v in policy.model.named_parameters()}]
    for group in groups:
        if cfg.engine == "native":
            engine.load_weights(group.items())
        else:
            engine.load_weights(weights_vllm_compat.compat_part_to_hf(group, policy.model.args))


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


def phase_metrics(times: dict) -> dict[str, float]:
    """time/<phase> seconds and memory/peak_gib/<phase> from what `timed` collected."""
    out = {}
    for k, v in times.items():
        out[f"memory/peak_gib/{k[5:]}" if k.startswith("peak:") else f"time/{k}"] = v
    return out


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**63)


def check_parity(samples: list[Sample], trainer_lps, step: int, run_dir: Path, engine, policy) -> ParityReport:
    """Every sampled token (every turn of a multi-turn trajectory): engine logprob == trainer's,
    bitwise. Collective: each rank checks its own samples, and if any rank differs the step fails
    on every rank with one ParityError naming the ranks (each differing rank writes its report)."""
    report = compare_logprobs([s.logprobs for s in samples], trainer_lps)
    failure = None if report.bitwise_identical else _report_mismatch(report, samples, trainer_lps, step, run_dir,
                                                                    engine, policy)
    world = policy.world
    failures = [(r, f) for r, f in enumerate(world.gather(failure)) if f is not None]
    if failures:
        where = "; ".join(f"rank {r}: {f}" if world.sharded else f for r, f in failures)
        raise ParityError(f"step {step}: {where}")
    return report


def _report_mismatch(report: ParityReport, samples, trainer_lps, step: int, run_dir: Path, engine, policy) -> str:
    """Write this rank's parity report (first differing token, and on one GPU with vLLM the first
    differing layer/op); returns the one-line summary."""
    i, j = report.first_mismatch or (0, 0)
    s = samples[i]
    position = [k for k, m in enumerate(s.loss_mask) if m][j]
    detail = {"step": step, "summary": report.summary(), "sequence_index": i, "sampled_token_index": j,
              "token_position": position, "ids": s.ids, "loss_mask": s.loss_mask,
              "engine_logprobs": s.logprobs.tolist(), "trainer_logprobs": trainer_lps[i].float().cpu().tolist(),
              "per_sequence_different": report.per_sample_different}
    if policy.world.sharded:
        detail["rank"] = policy.world.rank
        detail["localization"] = ("not run: it needs the whole model on one GPU; resume this run's last checkpoint "
                                  "without torchrun to localize")
    elif hasattr(engine, "llm"):  # vLLM: find the first layer/op that differs
        try:
            from types import SimpleNamespace

            from spirl.localize import localize_sample

            detail["localization"] = localize_sample(SimpleNamespace(engine=engine, model=policy.model),
                                                     s.ids[:position + 1])
        except Exception as e:  # the report must still be written
            detail["localization"] = f"localization failed: {type(e).__name__}: {e}"
    suffix = f"_rank{policy.world.rank}" if policy.world.sharded else ""
    path = run_dir / f"parity_failure_step{step:06d}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(detail, indent=1) + "\n")
    log.error("PARITY BROKEN at step %d: %s; sequence %d (%d tokens, %d sampled), token position %d; report: %s",
              step, report.summary(), i, len(s.ids), len(s.logprobs), position, path)
    if "localization" in detail:
        log.error("%s", detail["localization"])
    return f"{report.summary()} (report: {path})"


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


def train_minibatch(policy: Policy, samples, old_lps, ref_lps, adv, cfg: TrainConfig, device, times) -> dict:
    """One optimizer step over `samples`, accumulated over micro-batches of at most
    cfg.max_tokens_per_microbatch tokens. ref_lps is None when there is no KL term. Returns the
    mini-batch's loss metrics and the per-layer weight deltas. Sharded: every rank runs as many
    forward/backward passes as the rank with the most micro-batches (FSDP's collectives must pair
    up); the extra ones are zero-weight passes over a sequence, which add exact zeros."""
    n = len(samples)
    world = policy.world
    sums: dict[str, float] = {}
    dist = sampling_dist(cfg)
    slices: list[slice | None] = list(token_budget_slices([len(s.ids) for s in samples], cfg.max_tokens_per_microbatch))
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
        if world.any(not finite):
            what = f"loss is {loss.item()}" if not finite else "the loss is not finite on another rank"
            raise NonFiniteLossError(f"{what}; stopping (the last checkpoint is kept)")
        w = 0.0 if padding else (sl.stop - sl.start) / n  # per-sequence means, weighted: the mini-batch mean
        with timed(times, "backward"):
            (loss * w).backward()
            policy.grads_to_masters()
        if not padding:
            for k, v in {"loss": float(loss.detach()), **m}.items():
                sums[k] = sums.get(k, 0.0) + w * v
    sums = world.mean_over_ranks(sums)  # every rank holds the same number of sequences
    with timed(times, "optimizer"):
        if cfg.max_grad_norm > 0:
            clip_grad_norm(list(policy.masters.values()), cfg.max_grad_norm)
        deltas = step_with_deltas(policy.optimizer, world.all_sum)
        policy.optimizer.zero_grad(set_to_none=True)
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


def run_step(step: int, cfg: TrainConfig, task, engine, policy: Policy, device, run_dir: Path) -> dict:
    times: dict[str, float] = {}
    dist = sampling_dist(cfg)
    world = policy.world
    with timed(times, "rollout"):
        samples, metas, rewards, extra = collect(step, cfg, task, engine, world)
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
    if policy.ref is not None:
        with timed(times, "reference"), torch.no_grad():
            ref_lps = [x.float().cpu() for x in sampled_logprobs(policy.ref, samples, device, dist)]
    old_lps = [s.logprobs for s in samples]
    out = step_scalars(policy, samples, rewards, report, extra)
    if multi_turn and cfg.detect_retokenization:
        with torch.no_grad():
            out.update(detect_retokenization(samples, metas, task, policy.model, device))
    if not world.any(bool((adv != 0).any())):
        if world.is_main:  # decided over all ranks: said once
            log.warning("step %d: every group has equal rewards, so every advantage is 0: no update this step", step)
        out["skipped_update"] = 1.0
        return {**out, **phase_metrics(times)}
    per = len(samples) // cfg.updates_per_batch
    agg: dict[str, float] = {}
    for u in range(cfg.updates_per_batch):
        sl = slice(u * per, (u + 1) * per)
        m = train_minibatch(policy, samples[sl], old_lps[sl], None if ref_lps is None else ref_lps[sl],
                            adv[sl], cfg, device, times)
        for k, v in m.items():
            agg[k] = agg.get(k, 0.0) + v / cfg.updates_per_batch
    with timed(times, "weight_sync"):
        sync_weights(engine, policy, cfg)
    out.update(agg)
    out["skipped_update"] = 0.0
    return {**out, **phase_metrics(times)}
