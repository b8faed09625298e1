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
  4. rewards, group-relative advantages (--scale-rewards); with --dynamic-sampling or --filter, groups the
     filters drop are replaced by more sampled (spirl/loops/filters.py); with --vllm-sleep the engine then sleeps (KV cache
     freed, weights in host memory) until the weight sync;
  5. reference-policy logprobs (frozen copy of the initial weights; only when kl_coef > 0);
  6. if every advantage is zero (all groups had equal rewards) there is no learning signal: the
     step is logged with `skipped_update=1` and no optimizer step is taken (nothing to sync);
  7. updates_per_batch optimizer steps, each over one mini-batch split into micro-batches of at
     most max_tokens_per_microbatch tokens, with the loss --loss-type names (spirl/loops/update.py);
  8. weight sync to the engine; metrics (the checkpoints: spirl/loops/run.py).
With --off-policy-steps K (spirl/loops/ahead.py) steps 1-4 of step s + K run during step s: sampling beside
steps 5-7, its parity check and rewards just before the first optimizer step (the weights that sampled it); with
the engines on GPUs of their own, after step 8 instead, on a copy of those weights kept from before the update,
while the engine samples step s + K + 1 (Following; TrainConfig.checks_after_update).
With --partial-rollout-tokens C (spirl/loops/partial.py) step 2 samples at most C tokens per completion, continuing
those carried from earlier steps; only the groups whose completions have all ended are scored and trained.

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

from torchtitan_compat.config import sparse_layers

from ..core.distributed import even_slices
from ..core.policy import sync_weights
from ..numerics.parity import expert_load_scalars, sampled_logprobs
from . import ahead
from .rollout import Rollout, carry_open, collect, draw, generate_round
from .setup import Run
from .timing import phase_metrics, timed
from .loss import reward_std
from .update import Placeholder, sampling_dist, train_minibatch

log = logging.getLogger("spirl.loops.trainer")

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


def step_scalars(run: Run, ro: Rollout) -> dict:
    """The step's reward, parity and length scalars over every rank (on one process: of its own): rewards,
    parity and completion lengths of every sampled sequence (every round, kept or not), tokens_trained of
    what is trained. Rewards are gathered, so their mean and std are the one-process formulas (unscorable
    samples, NaN, left out; reward_std is the population std, or the sample std with --advantage-std sample)."""
    world = run.world
    sampled = sum(len(s.logprobs) for s in ro.sampled)
    trained = sum(len(s.logprobs) for s in ro.samples if not isinstance(s, Placeholder))
    compared, different, sampled, count, trained = world.all_sum([ro.report.tokens_compared, ro.report.tokens_different,
                                                                  sampled, len(ro.sampled), trained])
    every = torch.cat(world.gather(ro.sampled_rewards))
    scored = every[~torch.isnan(every)]
    out = {"reward_mean": float(scored.mean()) if scored.numel() else float("nan"),
           "reward_std": reward_std(every, run.cfg.advantage_std),
           "parity/tokens_compared": compared, "parity/tokens_different": different,
           "parity/max_abs_diff": world.all_max(ro.report.max_abs_diff),
           "completion_len_mean": sampled / count if count else float("nan"), "tokens_trained": trained}
    if world.sharded:
        for r, (c, d) in enumerate(world.gather((ro.report.tokens_compared, ro.report.tokens_different))):
            out[f"parity/rank{r}/tokens_compared"], out[f"parity/rank{r}/tokens_different"] = float(c), float(d)
    return {**out, **route_scalars(run, ro.report.routes), **ro.metrics}


def route_scalars(run: Run, routes) -> dict:
    """Qwen3-MoE: parity/routes_compared, parity/router_flips (token x layer pairs whose experts differ from the
    engine's), parity/routes_different (any slot), and the experts' load per layer, over every rank."""
    sparse = sparse_layers(run.policy.model.args)
    if not sparse or routes is None:
        return {}
    compared, flips, different = run.world.all_sum([routes.compared, routes.flips, routes.different])
    load = torch.stack(run.world.gather(routes.load)).sum(0) if run.world.sharded else routes.load
    return {"parity/routes_compared": compared, "parity/router_flips": flips, "parity/routes_different": different,
            **expert_load_scalars(load, sparse)}


def no_signal(step: int, out: dict) -> str:
    """Why a step whose advantages are all 0 takes no update, in one line."""
    if out.get("partial/groups_trained") == 0:
        return (f"step {step}: no group has all its completions ended yet ({out['partial/groups_carried']:.0f} "
                "carried to the next step, --partial-rollout-tokens): no update this step")
    if out["reward_mean"] != out["reward_mean"]:  # NaN: no sample of any rank was scorable
        return (f"step {step}: nothing could be scored (every reward function returned None for every completion), "
                "so every advantage is 0: no update this step")
    return f"step {step}: every group has equal rewards, so every advantage is 0: no update this step"


def run_step(run: Run, step: int, stop=None) -> dict | None:
    """One GRPO step of the run's policy; its scalars, with time/<phase> and time/step (the whole step's wall
    clock). With --off-policy-steps K it trains on the rollout sampled K updates earlier and samples the one
    of step + K meanwhile (spirl.loops.ahead). `stop()`: asked once after the rollouts this step had to wait
    for (every rank together); when it says so, the step ends there and returns None, nothing of it applied."""
    times: dict[str, float] = {}
    start = time.perf_counter()
    k = run.cfg.off_policy_steps
    for j in run.ahead.missing(step):  # K = 0: this step's; K > 0: before step 1, steps 1..K
        run.ahead.put(sample_ahead(run, j, step - 1, times))
    if stop is not None and stop():
        return None
    ready = run.ahead.pop(step)
    if hasattr(run.engine, "sleep"):
        run.engine.sleep()  # free the KV cache while the trainer trains (--vllm-sleep; K = 0 only)
    following, run.begun = (run.begun or Following(run, step + k, step - 1)) if k else None, None
    out = {**ready.scalars, **ahead.staleness(ready, step, k)}
    world = run.world
    if not world.any(bool((ready.advantages != 0).any())):
        if world.is_main:  # decided over all ranks: said once
            log.warning(no_signal(step, out))
        out["skipped_update"] = 1.0
        if following is not None:
            following.finish(times)
    elif following is not None and run.cfg.checks_after_update:
        out.update(train_on(run, ready, times, following.keep, lambda: following.generated(times)))
        out["skipped_update"] = 0.0
        following.after_update(step, times)
    else:
        out.update(train_on(run, ready, times, None if following is None else lambda: following.finish(times)))
        out["skipped_update"] = 0.0
    if following is not None:
        run.ahead.put(following.ready)
        # the engine's sampling beside the training (the part waited for is rollout_wait), plus what the trainer
        # sampled itself this step: step 1's first K rollouts, and the later rounds of a filtered one (--filter)
        times["rollout"] = times.get("rollout", 0.0) + following.seconds
    times["step"] = time.perf_counter() - start
    return {**out, **phase_metrics(times, world)}


def sample_ahead(run: Run, step: int, version: int, times: dict, started=None) -> ahead.Ready:
    """The rollout of `step`, sampled by the policy of `version` (the weights the trainer holds now), checked
    and scored; its scalars over every rank. `started`: its first round begun earlier (spirl.loops.ahead)."""
    ro = collect(run, step, times, started)
    world = run.world
    multi_turn = getattr(run.task, "multi_turn", False)
    if multi_turn and run.cfg.save_rollouts:
        suffix = f"_rank{world.rank}" if world.sharded else ""
        save_rollouts(run.run_dir / "rollouts" / f"step_{step:06d}{suffix}.jsonl", ro.sampled, ro.sampled_metas,
                      run.task, ro.sampled_rewards)
    out = step_scalars(run, ro)
    if multi_turn and run.cfg.detect_retokenization and ro.samples:
        with torch.no_grad():
            out.update(detect_retokenization(ro.samples, ro.metas, run.task, run.policy.model, run.device))
    return ahead.Ready(step, version, ro.samples, ro.advantages, out)


class Following:
    """The rollout of `step`, sampled during the step K before it trains (spirl.loops.ahead): its first round's
    prompts drawn now and its sampling begun beside the trainer (ahead.Background); `finish()`, called before
    the trainer's first optimizer update, waits for it and checks, scores and completes it (`sample_ahead`)
    while the trainer still holds the weights it was sampled with.

    TrainConfig.checks_after_update (engines on GPUs of their own): `keep()` copies those weights before the
    first update instead, `generated()` waits for the engine before the weight sync, and `after_update()` begins
    the next rollout (the engine has the new weights) before this one is checked and scored on the kept copy:
    the engine does not wait for the check, the optimizer step and the sync. The same numbers either way."""

    def __init__(self, run, step: int, version: int):
        self.position = run.source.position  # the data position before this draw (what a checkpoint records)
        run.source.begin(step)
        prompts = draw(run, step)
        threaded = bool(getattr(run.engine, "samples_beside_training", False))
        carried = run.partial.share(run.world) if run.cfg.partial_rollout_tokens else None  # taken now, not later
        self.started = ahead.Background(lambda: generate_round(run, step, 0, prompts, carried), threaded, run.device)
        self.run, self.step, self.version = run, step, version
        self.ready: ahead.Ready | None = None
        self.kept: dict | None = None

    @property
    def seconds(self) -> float:
        """How long the engine's sampling took (beside the trainer)."""
        return self.started.seconds

    def finish(self, times: dict) -> None:
        if self.ready is None:
            self.ready = sample_ahead(self.run, self.step, self.version, times, self.started)
            self.run.policy.release_gathered()  # the optimizer step follows: no stale gathered weights

    def keep(self) -> None:
        if self.kept is None:  # once, before the first update (train_on asks again when none was taken)
            self.kept = self.run.policy.keep_weights()

    def generated(self, times: dict) -> None:
        with timed(times, "rollout_wait"):  # the engine takes the new weights only once it is done
            self.started.result()

    def after_update(self, step: int, times: dict) -> None:
        """After step `step`'s update and weight sync: the next rollout begun (unless the run ends, or an eval,
        which uses the engine, follows this step), then this one checked and scored on the kept weights."""
        run, cfg = self.run, self.run.cfg
        if cfg.partial_rollout_tokens:  # the next rollout continues what this one left open
            carry_open(run, self.started.result().partial)
        if step < cfg.steps and not (cfg.eval_every and step % cfg.eval_every == 0):
            run.begun = Following(run, step + 1 + cfg.off_policy_steps, step)
        with run.policy.weights_of(self.kept):
            self.finish(times)
        self.kept = None

    def abandon(self) -> None:
        """The run stops with this rollout begun: wait for the engine (its result unused)."""
        self.started.join()


def data_position(run) -> int | None:
    """The data position a checkpoint after the current step records: before a rollout begun for a later step."""
    return run.begun.position if run.begun is not None else run.source.position


def train_on(run: Run, ro, times: dict, before_update=None, before_sync=None) -> dict:
    """Train on the rollout `ro` (its .samples and .advantages): reference logprobs when there is a KL term,
    --updates-per-batch optimizer steps (one per mini-batch), then the weight sync to the engine. Returns the
    mini-batches' mean metrics; with --off-policy-steps, also the first mini-batch's ratio (offpolicy/*: before
    this step's own updates). `before_update()`: called before the first optimizer step; `before_sync()`: before
    the weight sync."""
    cfg, policy, device, samples, adv = run.cfg, run.policy, run.device, ro.samples, ro.advantages
    world = policy.world
    ref_lps = None
    if policy.has_reference:
        with timed(times, "reference"), torch.no_grad(), policy.reference_model() as ref:
            ref_lps = [x.float().cpu() for x in sampled_logprobs(ref, samples, device, sampling_dist(cfg))]
    old_lps = [s.logprobs for s in samples]
    slices = even_slices(len(samples), cfg.updates_per_batch)  # the mini-batches
    real = [sum(not isinstance(s, Placeholder) for s in samples[sl]) for sl in slices]
    slices = [sl for sl, n in zip(slices, world.all_sum(real)) if n]  # none anywhere (few kept groups): no update
    agg: dict[str, float] = {}
    for i, sl in enumerate(slices):
        mb, mb_old, mb_ref, mb_adv = samples[sl], old_lps[sl], None if ref_lps is None else ref_lps[sl], adv[sl]
        if not mb:  # this rank has no sequence in this mini-batch: a zero-weight stand-in (update.Placeholder)
            mb, mb_old, mb_adv = [Placeholder(getattr(samples[0], "seq", samples[0]))], old_lps[:1], torch.zeros(1)
            mb_ref = None if ref_lps is None else ref_lps[:1]
        m = train_minibatch(policy, mb, mb_old, mb_ref, mb_adv, cfg, device, times, before_update if i == 0 else None)
        if i == 0 and cfg.off_policy_steps:
            agg.update(ahead.first_ratio(m))
        for k, v in m.items():
            agg[k] = agg.get(k, 0.0) + v / len(slices)
    if before_update is not None:  # no mini-batch had a sequence (no optimizer step): the engine is done first
        before_update()
    if before_sync is not None:
        before_sync()
    with timed(times, "weight_sync"):
        sync_weights(run.engine, policy, run.spec)
    return agg
