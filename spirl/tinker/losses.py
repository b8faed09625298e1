"""The loss functions Tinker's `forward_backward` names, as Tinker's documentation defines them.

Shapes: every tensor is [N] for one datum (N = its model_input length); position t predicts token
t + 1 of the sequence. `lp` = the trainer's log p(target_tokens[t]) under the model's own
distribution (no temperature); the other inputs come from the datum's `loss_fn_inputs`:

    cross_entropy        loss = -sum(lp * weights)
    importance_sampling  r = exp(lp - logprobs);  loss = -sum(r * advantages)
    ppo                  loss = -sum(min(r * A, clip(r, lo, hi) * A)),  lo, hi = clip_low_threshold,
                         clip_high_threshold of loss_fn_config (Tinker's defaults 0.8, 1.2)
    cispo                loss = -sum(stopgrad(clip(r, lo, hi)) * lp * A)      (same lo, hi)
    dro                  loss = -sum(lp * A - beta / 2 * (lp - logprobs)^2),  beta from loss_fn_config
                         (required: Tinker documents no default)

Every loss is a sum over tokens (and the caller sums over datums): any normalization is the
caller's, in `weights` or `advantages`. `ppo` and `cispo` are spirl.core.objectives' per-token surrogates,
the ones GRPO's loss menu trains with (spirl/loops/loss.py): one implementation each. `gspo` and
`stable_reinforce` are refused: Tinker does not publish stable_reinforce's objective, and gspo's clip
parameters are undocumented.
"""

from __future__ import annotations

import torch

from ..core import objectives

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
INPUTS = {"cross_entropy": ("weights",), "importance_sampling": ("logprobs", "advantages"),
          "ppo": ("logprobs", "advantages"), "cispo": ("logprobs", "advantages"), "dro": ("logprobs", "advantages")}
"""loss_fn_inputs each loss needs besides target_tokens."""
PPO_CLIP = (0.8, 1.2)
"""Tinker's documented ratio bounds for ppo and cispo when loss_fn_config gives none."""


class LossError(ValueError):
    """A loss function, its inputs or its config this backend cannot compute; one line."""


def check(name: str, config: dict | None) -> dict:
    """The loss's config with Tinker's defaults filled in; LossError for what cannot be computed."""
    config = dict(config or {})
    if name not in LOSSES:
        raise LossError(f"loss_fn {name!r} is not computed by SPIRL's Tinker backend: use one of {', '.join(LOSSES)} "
                        "or forward_backward_custom" + (" (Tinker does not publish stable_reinforce's objective)"
                                                        if name == "stable_reinforce" else ""))
    allowed = {"ppo": {"clip_low_threshold", "clip_high_threshold"}, "cispo": {"clip_low_threshold",
               "clip_high_threshold"}, "dro": {"beta"}}.get(name, set())
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise LossError(f"loss_fn_config keys {unknown} mean nothing to {name!r} (it reads {sorted(allowed) or 'none'})")
    if name in ("ppo", "cispo"):
        config.setdefault("clip_low_threshold", PPO_CLIP[0])
        config.setdefault("clip_high_threshold", PPO_CLIP[1])
    if name == "dro" and "beta" not in config:
        raise LossError("loss_fn 'dro' needs loss_fn_config={'beta': ...}: Tinker documents no default")
    return config


def loss(name: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The scalar loss of one datum (see the module docstring); `config` from `check`."""
    if name == "cross_entropy":
        return -(lp * inputs["weights"]).sum()
    old, adv = inputs["logprobs"], inputs["advantages"]
    if name == "dro":
        return -(lp * adv - 0.5 * config["beta"] * (lp - old) ** 2).sum()
    ratio = torch.exp(lp - old)
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    if name == "ppo":
        return objectives.ppo_clip(ratio, adv, low, high).sum()
    return objectives.cispo(ratio, lp, adv, low, high).sum()


class HandleLoss:
    """A `LossHandle` (ServiceClient.create_custom_loss) run per datum inside the training forward.

    The handle's traced graph (the SDK's `trace_loss`: torch and math only) maps (logprobs [N],
    *the loss_fn_inputs it names) to (scalar loss, {custom/<name>:sum|mean: scalar}). The datum
    losses are summed, as the SDK's client-side `run_loss_handle` does (not called itself: it reads the
    inputs as CPU tensors, and the logprobs here are on the trainer's device, per micro-batch); metrics
    ending in `:sum` are summed over datums, `:mean` averaged. Being per datum, the loss is micro-batched like the
    built-in ones (a callable passed to forward_backward_custom sees every datum at once). The SDK's
    own `check_loss_inputs` validates the data up front (a one-line error at the call).
    """

    per_datum = True

    def __init__(self, handle, data):
        from tinker.lib.public_interfaces.custom_loss import check_loss_inputs

        if handle.inputs[0].rank != 1:
            raise LossError(f"custom loss {handle.name!r} takes logprobs of rank {handle.inputs[0].rank}; SPIRL's "
                            "backend computes the target token's logprob ([T], rank 1), not top-k ([T, K])")
        check_loss_inputs(handle, data)
        self.handle, self.datums, self._sums = handle, len(data), {}

    def __call__(self, data, logprobs_list: list[torch.Tensor]):
        total = None
        for d, lp in zip(data, logprobs_list, strict=True):
            inputs = [d.loss_fn_inputs[k].to_torch().to(lp.device) for k in self.handle.input_names]
            loss, metrics = self.handle.graph(lp, *inputs)
            if loss.ndim != 0:
                raise LossError(f"custom loss {self.handle.name!r} must return a scalar loss, got shape "
                                f"{tuple(loss.shape)}")
            total = loss if total is None else total + loss
            for k, v in metrics.items():
                self._sums[k] = self._sums.get(k, 0.0) + float(v.detach())
        return total, {k: v / self.datums if k.endswith(":mean") else v for k, v in self._sums.items()}
