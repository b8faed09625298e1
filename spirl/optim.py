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


@torch.no_grad()
def step_with_deltas(opt: torch.optim.Optimizer) -> dict[str, float]:
    """opt.step(), one parameter group at a time; returns per layer ||W_t - W_{t-1}|| and its ratio
    to ||W_{t-1}|| (float64 sums), holding one layer's previous weights at a time."""
    all_groups = opt.param_groups
    out: dict[str, float] = {}
    try:
        for group in all_groups:
            before = [p.detach().clone() for p in group["params"]]
            opt.param_groups = [group]
            opt.step()
            diff_sq = sum(float((p.double() - b.double()).pow(2).sum()) for p, b in zip(group["params"], before))
            prev_sq = sum(float(b.double().pow(2).sum()) for b in before)
            layer = group["layer"]
            out[f"weight_delta/{layer}/magnitude"] = math.sqrt(diff_sq)
            out[f"weight_delta/{layer}/relative_change"] = math.sqrt(diff_sq) / max(math.sqrt(prev_sq), 1e-30)
    finally:
        opt.param_groups = all_groups
    return out
