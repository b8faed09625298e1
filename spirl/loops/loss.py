"""GRPO: group-relative advantages and the PPO-clipped policy loss with a k3 KL to a reference.

Written after torchtitan's experiments/rl GRPO loss: ratio = exp(logp - logp_old), clipped
surrogate, KL penalty from the k3 estimator, and an optional entropy bonus.

Reduction (both the loss and every metric): the mean over each sequence's completion tokens
first, then the mean over sequences, so every sample weighs the same whatever its length.
"""

from __future__ import annotations

import torch

ADV_EPS = 1e-6


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = ADV_EPS) -> torch.Tensor:
    """rewards float [B*G] (prompt-major, G = group_size per prompt) -> advantages float32 [B*G].

    A_i = (r_i - mean(group)) / (std(group) + eps), with the *population* std (divide by G,
    `unbiased=False`): a group of equal rewards gives exactly 0, never NaN."""
    r = rewards.to(torch.float32)
    if r.ndim != 1 or r.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(r.shape)}")
    g = r.view(-1, group_size)
    mean = g.mean(dim=1, keepdim=True)
    std = g.std(dim=1, unbiased=False, keepdim=True)
    return ((g - mean) / (std + eps)).reshape(-1)


def _seq_then_batch_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x, mask [N, L] -> scalar: masked mean over each row, then mean over rows."""
    per_seq = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_seq.mean()


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float, kl_coef: float,
              entropy: torch.Tensor | None = None, entropy_coef: float = 0.0
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss over N sequences padded to L sampled tokens.

    logprobs      float [N, L]  current policy log p(token), differentiable
    old_logprobs  float [N, L]  policy that sampled the tokens (the rollout's, = trainer's by parity)
    ref_logprobs  float [N, L]  frozen reference policy, or None (no KL term: kl_coef must be 0)
    advantages    float [N]     one per sequence (grpo_advantages)
    mask          bool/float [N, L]  1 on real sampled tokens, 0 on padding
    entropy       float [N, L] or None  per-token entropy of the current policy
    Returns (scalar loss, metrics) with metrics pg_loss, kl_div (only with a reference), entropy,
    ratio_mean, ratio_clipped_frac as Python floats. Per token:
        pg  = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))
        kl  = exp(ref - logp) - (ref - logp) - 1          (k3, >= 0, unbiased for KL(pi || ref))
        loss_t = pg + kl_coef * kl - entropy_coef * entropy
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = torch.maximum(unclipped, clipped)
    if ref_logprobs is None:
        if kl_coef:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        kl, per_token = None, pg
    else:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1.0
        per_token = pg + kl_coef * kl
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    loss = _seq_then_batch_mean(per_token, mask)

    with torch.no_grad():
        # "clipped" = the clipped branch is the active one, i.e. this token gets no gradient
        is_clipped = (clipped > unclipped).to(mask.dtype)
        metrics = {
            "pg_loss": float(_seq_then_batch_mean(pg, mask)),
            "entropy": float(_seq_then_batch_mean(entropy, mask)) if entropy is not None else 0.0,
            "ratio_mean": float(_seq_then_batch_mean(ratio, mask)),
            "ratio_clipped_frac": float(_seq_then_batch_mean(is_clipped, mask)),
        }
        if kl is not None:
            metrics["kl_div"] = float(_seq_then_batch_mean(kl, mask))
    return loss, metrics


def pad(rows: list[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """list of 1-D tensors (differentiable) -> (padded [N, L], bool mask [N, L])."""
    out = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)
    lengths = torch.tensor([r.numel() for r in rows], device=out.device)
    mask = torch.arange(out.shape[1], device=out.device)[None, :] < lengths[:, None]
    return out, mask
