"""GRPO's loss menu: group-relative advantages, the policy loss of each loss type, and the normalizers
that make a loss over micro-batches and ranks the loss of the whole mini-batch.

Written after torchtitan's experiments/rl GRPO loss, with TRL 1.16's GRPOConfig names and semantics
(README "Your own experiment" has the table). Per token t of sequence i (mask m_{i,t}: 1 on sampled
tokens; 0 on padding and, with --mask-truncated-completions, on every token of a truncated completion):

    r       importance ratio, per token or per sequence (GSPO)       spirl.core.objectives.importance_ratio
    l_{i,t} = surrogate(r, A_i) + kl_coef * k3_{i,t} - entropy_coef * H_{i,t}
              surrogate: PPO clip to [1 - eps, 1 + eps_high] (grpo, dr_grpo, dapo, bnpo), or CISPO's
              -sg(min(r, eps_max)) A logp (cispo)                       spirl.core.objectives
    loss    = sum_i c_i sum_t m_{i,t} l_{i,t}, with c_i by loss type (`sequence_weights`):
              grpo     1 / (N |o_i|)        each sequence's token mean, then the mean over sequences
              dr_grpo  1 / (N L_max)        L_max = the longest completion allowed (Dr. GRPO)
              dapo     1 / sum_j |o_j|      the token mean over the mini-batch (DAPO)
              bnpo     1 / sum_j |o_j|      the same here (see `sequence_weights`)
              cispo    1 / sum_j |o_j|      as dapo (TRL)
    N = sequences of the mini-batch, |o_i| = the masked-in tokens of sequence i, both over every rank.

The normalizers are computed once per mini-batch over all its micro-batches and all ranks, so the
sum of the micro-batches' losses is the mini-batch's loss, and N ranks train what one process trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import objectives
from ..core.config import ADVANTAGE_STDS, LOSS_TYPES, REWARD_SCALES

ADV_EPS = 1e-6


# -- advantages ---------------------------------------------------------------------------------------------


def _nan_std(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Population std (divide by the count) over the non-NaN entries; 0 where fewer than one."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=keepdim)
    return torch.nan_to_num(var, nan=0.0).sqrt()


def _nan_sample_std(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected std (divide by the count - 1) over the non-NaN entries, NaN where fewer than two: TRL
    1.16's `trl.trainer.utils.nanstd`, operation for operation."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var * correction)
    return std if keepdim or dim is None else std.squeeze(dim)


ADV_EPS_SAMPLE = 1e-4
"""TRL's epsilon in A = (r - mean) / (std + eps)."""


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float | None = None, scale: str = "group",
                    std: str = "population") -> torch.Tensor:
    """rewards float [B*G] (prompt-major, G = group_size per prompt; NaN = unscorable: every reward function
    returned None) -> advantages float32 [B*G].

        A_i = (r_i - mean(group)) / (std + eps)
          scale="group": std of the group   (the GRPO paper; TRL's scale_rewards="group")
          scale="batch": std of the whole batch, every group   (TRL's "batch", PPO-Lite)
          scale="none":  no division: A_i = r_i - mean(group)   (Dr. GRPO; TRL's "none")
          std="population": divide by the count, eps 1e-6 (SPIRL's default, unchanged)
          std="sample": Bessel-corrected, eps 1e-4: TRL 1.16's formula operation for operation (a group with
                        fewer than two scorable rewards gets advantage 0 there, as in TRL)
    Means and stds skip unscorable rewards (TRL's nanmean / nanstd), and an unscorable sample's advantage is 0.
    A group of equal rewards gives exactly 0 (never NaN)."""
    r = rewards.to(torch.float32)
    if r.ndim != 1 or r.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(r.shape)}")
    if scale not in REWARD_SCALES:
        raise ValueError(f"scale must be one of {', '.join(REWARD_SCALES)}, got {scale!r}")
    if std not in ADVANTAGE_STDS:
        raise ValueError(f"std must be one of {', '.join(ADVANTAGE_STDS)}, got {std!r}")
    g = r.view(-1, group_size)
    if eps is None:
        eps = ADV_EPS_SAMPLE if std == "sample" else ADV_EPS
    if std == "population" and not torch.isnan(r).any():
        # every reward scored: mean and std themselves, not their NaN-skipping forms, which round differently in the
        # last bit on some CPUs (AMD EPYC, 2026-11-27), so that the default stays the formula SPIRL always used
        centered = g - g.mean(dim=1, keepdim=True)
        if scale == "group":
            centered = centered / (g.std(dim=1, unbiased=False, keepdim=True) + eps)
        elif scale == "batch":
            centered = centered / (r.std(unbiased=False) + eps)
        return centered.reshape(-1)
    nan_std = _nan_sample_std if std == "sample" else _nan_std
    centered = g - torch.nanmean(g, dim=1, keepdim=True)
    if scale == "group":
        centered = centered / (nan_std(g, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (nan_std(r) + eps)
    return torch.nan_to_num(centered, nan=0.0).reshape(-1)


def reward_std(rewards: torch.Tensor, std: str = "population") -> float:
    """The logged reward_std of the scorable (non-NaN) rewards: population (divide by the count) or sample
    (Bessel-corrected, TRL's reward_std); NaN when nothing was scored (or, for sample, only one reward)."""
    r = rewards[~torch.isnan(rewards)]
    if std == "sample":
        return float(_nan_sample_std(r)) if r.numel() else float("nan")
    return float(r.std(unbiased=False)) if r.numel() else float("nan")


# -- normalizers --------------------------------------------------------------------------------------------


@dataclass
class SequenceWeights:
    """Per-sequence weights of one rank's share of a mini-batch, each spanning the whole mini-batch on every
    rank and already multiplied by the number of ranks (the ranks' gradients and metrics are averaged, so
    each rank's share is scaled to make the average their sum; on one process the factor is 1).

    loss  float [n]  c_i: the loss is sum_i loss_i sum_t m_{i,t} l_{i,t}  (module docstring)
    mean  float [n]  1 / (N |o_i|): each sequence's token mean, then the mean over sequences (the metrics)
    keep  float [n]  1, or 0 for a truncated completion under --mask-truncated-completions"""

    loss: torch.Tensor
    mean: torch.Tensor
    keep: torch.Tensor

    def __getitem__(self, sl: slice) -> "SequenceWeights":
        return SequenceWeights(self.loss[sl], self.mean[sl], self.keep[sl])

    def to(self, device) -> "SequenceWeights":
        return SequenceWeights(self.loss.to(device), self.mean.to(device), self.keep.to(device))


def sequence_weights(loss_type: str, lengths: list[int], truncated: list[bool], max_completion_len: int,
                     mask_truncated: bool = False, counted: list[bool] | None = None, world=None) -> SequenceWeights:
    """lengths [n] (sampled tokens of each of this rank's sequences), truncated [n] (the completion did not
    end on its own) -> SequenceWeights; `counted` [n]: False for a placeholder sequence (a rank with nothing
    to train runs one, with zero weights, so its collectives pair up). N and sum_j |o_j| are all_sum-ed over
    `world` (spirl.core.distributed.World; None = one process).

        grpo     c_i = k_i / (N |o_i|)                 TRL: per-sequence mean, then .mean()
        dr_grpo  c_i = k_i / (N L_max)                 TRL: sum / (B * max_completion_length)
        dapo     c_i = k_i / sum_j k_j |o_j|           TRL: sum / num_items_in_batch (active tokens)
        bnpo     as dapo. TRL divides by the active tokens of each per-device micro-batch, so its loss
                 depends on how the batch is split; here the batch is the mini-batch (micro-batches are
                 only a memory device and ranks train what one process trains), which makes it dapo's.
        cispo    as dapo (TRL).
    k_i = 0 for a truncated completion with mask_truncated (TRL zeroes its completion mask: it still counts
    in N, not in the active tokens), else 1; |o_i| is clamped to >= 1."""
    n = len(lengths)
    counted = [True] * n if counted is None else counted
    k = torch.tensor([0.0 if (mask_truncated and t) or not c else 1.0 for t, c in zip(truncated, counted)],
                     dtype=torch.float64)
    length = torch.tensor(lengths, dtype=torch.float64).clamp(min=1.0)
    real = torch.tensor(counted, dtype=torch.float64)
    local = [float(real.sum()), float((k * length).sum())]
    size = 1
    if world is not None:
        local, size = world.all_sum(local), world.size
    seqs, tokens = local[0], max(local[1], 1.0)
    if seqs == 0:
        raise ValueError("a mini-batch without sequences")
    if loss_type == "grpo":
        c = k / (seqs * length)
    elif loss_type == "dr_grpo":
        c = k / (seqs * max_completion_len)
    elif loss_type in ("dapo", "bnpo", "cispo"):
        c = k / tokens
    else:
        raise ValueError(f"loss type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    mean = real / (seqs * length)
    return SequenceWeights((c * size).float(), (mean * size).float(), k.float())


# -- the loss -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossMenu:
    """Which loss (TrainConfig's --loss-type, --importance-sampling-level, --clip-eps-high). clip_high: 1 +
    clip_high bounds the ratio from above (ppo surrogates); for cispo the weight's bound eps_max itself."""

    loss_type: str = "grpo"
    level: str = "token"
    clip_high: float | None = None
    """None: the same as the lower epsilon (clip_eps)."""

    @classmethod
    def from_config(cls, cfg) -> "LossMenu":
        return cls(cfg.loss_type, cfg.importance_sampling_level, cfg.clip_eps_high or None)


GRPO = LossMenu()


def _weighted(x: torch.Tensor, mask: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, L] or [N, 1], mask [N, L], w [N] -> sum_i w_i sum_t m_{i,t} x_{i,t} (scalar)."""
    return ((x * mask).sum(dim=1) * w).sum()


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float, kl_coef: float,
              entropy: torch.Tensor | None = None, entropy_coef: float = 0.0, menu: LossMenu = GRPO,
              weights: SequenceWeights | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss over N sequences padded to L sampled tokens (the module docstring's formula).

    logprobs      float [N, L]  current policy log p(token), differentiable
    old_logprobs  float [N, L]  policy that sampled the tokens (the rollout's, = trainer's by parity)
    ref_logprobs  float [N, L]  frozen reference policy, or None (no KL term: kl_coef must be 0)
    advantages    float [N]     one per sequence (grpo_advantages)
    mask          bool/float [N, L]  1 on real sampled tokens, 0 on padding
    entropy       float [N, L] or None  per-token entropy of the current policy
    menu          the loss type, importance-sampling level and upper clip (LossMenu)
    weights       SequenceWeights of these N sequences (`sequence_weights`: normalizers over the whole
                  mini-batch and every rank); None = these N are the whole batch, on one process
    Returns (scalar loss, metrics): the loss and pg_loss (the surrogate term alone) aggregated as the loss
    type says; kl_div (only with a reference), entropy, ratio_mean, ratio_sq_mean (of r^2: the ratio's spread)
    and ratio_clipped_frac (the share of tokens whose clip is active: ppo, the clipped branch; cispo,
    r > eps_max) as each sequence's mean, then
    the mean over sequences. With `weights`, every value is this part's share of the mini-batch's (summed
    over micro-batches and averaged over ranks, they are the mini-batch's). Per token:
        pg  = -min(r A, clip(r, 1 - eps, 1 + eps_high) A)     or cispo's  -sg(min(r, eps_max)) A logp
        kl  = exp(ref - logp) - (ref - logp) - 1              (k3, >= 0, unbiased for KL(pi || ref))
        loss_t = pg + kl_coef * kl - entropy_coef * entropy
    """
    mask = mask.to(logprobs.dtype)
    if weights is None:
        lengths = mask.sum(dim=1).long().tolist()
        weights = sequence_weights(menu.loss_type, lengths, [False] * len(lengths), mask.shape[1])
    weights = weights.to(logprobs.device)
    adv = advantages.to(logprobs.dtype)[:, None]
    ratio = objectives.importance_ratio(logprobs, old_logprobs, mask, menu.level)
    high = menu.clip_high if menu.clip_high is not None else clip_eps
    if menu.loss_type == "cispo":
        pg = objectives.cispo(ratio, logprobs, adv, None, high)
        is_clipped = ratio > high
    else:
        pg = objectives.ppo_clip(ratio, adv, 1.0 - clip_eps, 1.0 + high)
        is_clipped = objectives.ppo_clipped(ratio, adv, 1.0 - clip_eps, 1.0 + high)
    if ref_logprobs is None:
        if kl_coef:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        kl, per_token = None, pg
    else:
        kl = objectives.k3_kl(logprobs, ref_logprobs)
        per_token = pg + kl_coef * kl
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    loss = _weighted(per_token, mask, weights.loss)

    with torch.no_grad():
        mean = weights.mean
        metrics = {
            "pg_loss": float(_weighted(pg, mask, weights.loss)),
            "entropy": float(_weighted(entropy, mask, mean)) if entropy is not None else 0.0,
            "ratio_mean": float(_weighted(ratio, mask, mean)),
            "ratio_sq_mean": float(_weighted(ratio * ratio, mask, mean)),
            "ratio_clipped_frac": float(_weighted(is_clipped.to(mask.dtype), mask, mean)),
        }
        if kl is not None:
            metrics["kl_div"] = float(_weighted(kl, mask, mean))
    return loss, metrics


def pad(rows: list[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """list of 1-D tensors (differentiable) -> (padded [N, L], bool mask [N, L])."""
    out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)
    lengths = torch.tensor([r.numel() for r in rows], device=out.device)
    mask = torch.arange(out.shape[1], device=out.device)[None, :] < lengths[:, None]
    return out, mask
