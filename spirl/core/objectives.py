"""Per-token policy-gradient objectives both clients train with: GRPO's loss menu (spirl/loops/loss.py) and
the Tinker API's `forward_backward` losses (spirl/tinker/losses.py). One implementation of each, so that a
loss both offer is the same function.

Shapes: `ratio`, `logprobs`, `advantages` broadcast against each other: [N, L] per token, [N, 1] for a
per-sequence ratio or advantage, or [T] for one Tinker datum. Bounds are absolute (the ratio's own
limits, e.g. 0.8 and 1.2, not epsilons); None leaves that side unbounded. Each returns the per-token
loss (to be masked and aggregated by the caller), minimised by gradient descent.
"""

from __future__ import annotations

import torch


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                     level: str = "token") -> torch.Tensor:
    """logprobs, old_logprobs, mask [N, L] -> the importance ratio pi / pi_old.

        token     r_{i,t} = exp(logp_{i,t} - logp_old_{i,t})                          [N, L]
        sequence  s_i = exp(sum_t m_{i,t} (logp - logp_old)_{i,t} / max(sum_t m_{i,t}, 1))   [N, 1]
                  (GSPO, arXiv 2507.18071: the length-normalized sequence likelihood ratio; TRL's
                  importance_sampling_level="sequence")
    """
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        m = mask.to(log_ratio.dtype)
        return torch.exp((log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0))
    raise ValueError(f"importance sampling level must be token or sequence, got {level!r}")


def ppo_clip(ratio: torch.Tensor, advantages: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """The PPO clipped surrogate, per token:  -min(r A, clip(r, low, high) A).

    GRPO's (and DAPO's clip-higher: high = 1 + eps_high > 1 + eps_low = 2 - low) and Tinker's `ppo`
    (low, high = clip_low_threshold, clip_high_threshold)."""
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)


def ppo_clipped(ratio: torch.Tensor, advantages: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """bool: the clipped branch of `ppo_clip` is the active one (the token gets no policy gradient)."""
    return torch.clamp(ratio, low, high) * advantages < ratio * advantages


def cispo(ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, low: float | None,
          high: float | None) -> torch.Tensor:
    """CISPO (MiniMax-M1, arXiv 2506.13585), per token:  -sg(clip(r, low, high)) A logp.

    The importance weight is clipped and held constant (stop-gradient), so every token keeps a
    gradient A clip(r) d logp. TRL's loss_type="cispo" is low=None, high=epsilon_high (ScaleRL's
    eps_max); Tinker's `cispo` clips to [clip_low_threshold, clip_high_threshold]."""
    return -(torch.clamp(ratio, low, high).detach() * advantages * logprobs)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL(pi || ref) per token:  exp(ref - logp) - (ref - logp) - 1  (>= 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0
