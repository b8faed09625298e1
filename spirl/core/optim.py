"""AdamW on the fp32 master weights, one parameter group per layer, and per-layer update sizes
measured without a second copy of the model.

Why groups: the weight-change metrics need W_t - W_{t-1} per layer. Keeping a full fp32 copy of
W_{t-1} costs 4 bytes per parameter (6.8 GB at Qwen3-1.7B, 33 GB at 8B) of GPU memory. AdamW
updates every parameter independently (its state is per parameter, keyed by the tensor), so
stepping the groups one after another is the same arithmetic as one step over all of them; then
only one layer's weights are copied at a time.
"""

from __future__ import annotations

import math

import torch

from .metrics import layer_of


def build_adamw(masters: dict[str, torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with one group per layer (`metrics.layer_of`), groups and parameters in model order."""
    groups: dict[str, list[torch.nn.Parameter]] = {}
    for name, p in masters.items():
        groups.setdefault(layer_of(name), []).append(p)
    return torch.optim.AdamW([{"params": ps, "layer": layer} for layer, ps in groups.items()],
                             lr=lr, weight_decay=weight_decay, foreach=False)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, split into its two halves (the same arithmetic) so that the
    norm of sharded gradients (FSDP2's DTensors) is made whole before the clip, as torchtitan does."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


@torch.no_grad()
def step_with_deltas(opt: torch.optim.Optimizer, all_sum=None) -> dict[str, float]:
    """opt.step(), one parameter group at a time; returns per layer ||W_t - W_{t-1}|| and its ratio
    to ||W_{t-1}|| (float64 sums), holding one layer's previous weights at a time. Sharded
    parameters: each rank sums its own shard and `all_sum` (spirl.core.distributed.World.all_sum) adds
    the ranks' sums."""
    from .distributed import local

    all_groups = opt.param_groups
    sums: list[float] = []
    try:
        for group in all_groups:
            before = [local(p).detach().clone() for p in group["params"]]
            opt.param_groups = [group]
            opt.step()
            sums.append(sum(float((local(p).double() - b.double()).pow(2).sum())
                            for p, b in zip(group["params"], before)))
            sums.append(sum(float(b.double().pow(2).sum()) for b in before))
    finally:
        opt.param_groups = all_groups
    if all_sum is not None:
        sums = all_sum(sums)
    out: dict[str, float] = {}
    for i, group in enumerate(all_groups):
        diff_sq, prev_sq = sums[2 * i], sums[2 * i + 1]
        layer = group["layer"]
        out[f"weight_delta/{layer}/magnitude"] = math.sqrt(diff_sq)
        out[f"weight_delta/{layer}/relative_change"] = math.sqrt(diff_sq) / max(math.sqrt(prev_sq), 1e-30)
    return out
