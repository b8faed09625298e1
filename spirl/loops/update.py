"""One optimizer update over a mini-batch: micro-batches of at most --max-tokens-per-microbatch tokens, the loss
--loss-type names (spirl/loops/loss.py) with its normalizers over the whole mini-batch and every rank, the
gradients into the fp32 masters, the optimizer step and the new weights into the compute model.

A NaN/Inf loss stops the run before any gradient of it is applied (NonFiniteLossError). FSDP-sharded, every rank
runs as many forward/backward passes as the rank with the most micro-batches (FSDP's collectives must pair up);
the extra ones are zero-weight passes, which add exact zeros.
"""

from __future__ import annotations

import torch

from torchtitan_compat.model import LayerRecord

from ..core.config import TrainConfig
from ..core.optim import clip_grad_norm, step_with_deltas
from ..core.policy import Policy
from ..numerics.parity import SamplingDist, logprob_dist, sampled_logprobs_and_entropy
from .loss import LossMenu, SequenceWeights, grpo_loss, pad, sequence_weights
from .timing import timed


class NonFiniteLossError(RuntimeError):
    """The loss became NaN/Inf; the run stops with the last good checkpoint kept."""


class Placeholder:
    """A sequence a rank trains on with zero weight when its share of the kept groups is empty (the
    ranks' forward and backward passes are collectives, so each must run them): `sequence_weights` gives
    it no weight and counts it in no normalizer, and it is in no metric."""

    def __init__(self, seq):
        self.seq = seq

    ids = property(lambda self: self.seq.ids)
    loss_mask = property(lambda self: self.seq.loss_mask)
    logprobs = property(lambda self: self.seq.logprobs)
    finish_reason = property(lambda self: self.seq.finish_reason)


def sampling_dist(cfg: TrainConfig) -> SamplingDist:
    """The distribution whose logprobs engine and trainer compare and train on (--logprobs)."""
    return logprob_dist(cfg.logprobs, cfg.temperature, cfg.min_p)


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
                     device, token_share: float = 1.0) -> tuple[torch.Tensor, dict]:
    """(loss, its metrics) of one micro-batch: the trainer's forward (logprobs and entropy under the run's
    sampling distribution) and the loss --loss-type names, with the mini-batch's normalizers `weights`;
    with --router-aux-loss, plus the routers' load-balancing loss weighted by `token_share`, the micro-batch's share
    of the mini-batch's tokens."""
    router = (LayerRecord(), LayerRecord()) if cfg.router_aux_loss else None
    lps, ent = sampled_logprobs_and_entropy(policy.model, samples, device, sampling_dist(cfg),
                                            entropy_grad=cfg.entropy_coef > 0, router=router)
    lp, mask = pad(lps)
    ref = None if ref_lps is None else pad(ref_lps)[0].to(device)
    loss, metrics = grpo_loss(lp, pad(old_lps)[0].to(device), ref, adv.to(device), mask, cfg.clip_eps, cfg.kl_coef,
                              pad(ent)[0], cfg.entropy_coef, LossMenu.from_config(cfg), weights)
    if router is not None:
        loss, metrics = _with_router_aux_loss(policy, samples, router, token_share, loss, metrics)
    return loss, metrics


def _with_router_aux_loss(policy: Policy, samples, router: tuple[dict, dict], token_share: float, loss, metrics):
    """loss + router_aux_loss_coef x token_share x the micro-batch's load-balancing loss (moe.load_balancing_loss
    over every token of its sequences); router_aux_loss logged weighted the same way (over the micro-batches and
    ranks: the token-weighted mean)."""
    from torchtitan_compat.moe import load_balancing_loss

    args = policy.model.args
    layers = sorted(router[0])
    aux = load_balancing_loss([router[0][i] for i in layers], [router[1][i] for i in layers],
                              args.moe_args.num_experts)
    if any(isinstance(s, Placeholder) for s in samples):
        token_share = 0.0
    return (loss + args.router_aux_loss_coef * token_share * aux,
            {**metrics, "router_aux_loss": float(aux.detach()) * token_share})


def train_minibatch(policy: Policy, samples, old_lps, ref_lps, adv, cfg: TrainConfig, device, times,
                    before_update=None) -> dict:
    """One optimizer step over `samples`, accumulated over micro-batches of at most
    cfg.max_tokens_per_microbatch tokens. ref_lps is None when there is no KL term. Returns the
    mini-batch's loss metrics and the per-layer weight deltas. `before_update()`: called once the gradients
    are computed, before the optimizer changes any weight (--off-policy-steps checks the rollout sampled
    meanwhile under the weights it was sampled with). FSDP-sharded: every rank runs as many
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
    total_tokens = world.all_sum([sum(len(s.ids) for s in samples if not isinstance(s, Placeholder))])[0] \
        if cfg.router_aux_loss else 0
    for sl in slices:
        padding = sl is None
        sl = slice(0, 1) if padding else sl
        # --router-aux-loss: this micro-batch's share of the mini-batch's tokens, scaled by the ranks as the loss
        # is (their gradients are averaged)
        share = 0.0 if padding or not total_tokens else sum(len(s.ids) for s in samples[sl]) * world.size / total_tokens
        with timed(times, "forward"):
            loss, m = micro_batch_loss(policy, samples[sl], old_lps[sl], None if ref_lps is None else ref_lps[sl],
                                       adv[sl], weights[sl], cfg, device, share)
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
    if before_update is not None:
        before_update()
    with timed(times, "optimizer"):
        policy.reduce_grads()
        if cfg.max_grad_norm > 0:
            clip_grad_norm(list(policy.masters.values()), cfg.max_grad_norm)
        deltas = step_with_deltas(policy.optimizer, world.all_sum if policy.fsdp else None)  # replicas: own sums
        policy.optimizer.zero_grad(set_to_none=True)
    with timed(times, policy.merge_phase):
        policy.push_masters_to_model()
    return {**sums, **deltas}
