"""LoRA on a Qwen3-MoE's experts, in PEFT's layout for stacked expert parameters (`target_parameters`).

An expert parameter W [E, out, in] (experts.gate_up_proj [E, 2I, D] or experts.down_proj [E, D, I]) gets, per
expert e, a rank-r update s B_e A_e. PEFT 0.21 (`lora.ParamWrapper`, on transformers 5's Qwen3MoeExperts) stores
the E adapters as two matrices, and so does this module:

    A  [r*E, in]    expert-major:  A_e = A.view(E, r, in)[e]
    B  [out, r*E]   expert-minor:  B_e = B.view(out, r, E)[:, :, e]
    W'[e] = round(W[e] + s B_e A_e), the delta computed as PEFT's `get_delta_weight` computes it
            (einsum "o r e, e r i -> e o i" in float32, times s), added to float32(W), rounded once

Gate and up are one parameter (gate_up_proj) with one A: PEFT's own format for transformers 5's fused experts.
As for attention (torchtitan_compat/lora.py), W' is what the forward multiplies by, the rollout engine's own
FusedMoE tensor (w13 / w2), rewritten in place by `merge` after every optimizer step; the frozen base W stays in
pinned host memory or on the GPU; A and B are float32 parameters. The experts' kernels are unchanged:
`ExpertsDeltaFunction` hands the sparse block W' as a function of (A, B), so the experts' backward
(torchtitan_compat.moe.ExpertsFunction: dW' as grouped GEMMs) gives dA and dB.
"""

from __future__ import annotations

import math

import torch
from torch import nn

PARAMS = ("gate_up_proj", "down_proj")
"""The experts' parameters LoRA can adapt, in the order of transformers' Qwen3MoeExperts (PEFT nests its wrappers
in this order: with both adapted, gate_up_proj's adapter is the inner one, `experts.base_layer.lora_*`)."""


def delta(a: torch.Tensor, b: torch.Tensor, scale: float, num_experts: int) -> torch.Tensor:
    """s B_e A_e for every expert, [E, out, in], in float32 (float64 for float64 adapters): PEFT's
    `ParamWrapper.get_delta_weight` for experts stored (experts, out, in)."""
    cdt = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    a3 = a.to(cdt).reshape(num_experts, -1, a.shape[-1])
    b3 = b.to(cdt).reshape(b.shape[0], -1, num_experts)
    return torch.einsum("o r e, e r i -> e o i", b3, a3) * scale


def merged_experts(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, out_dtype: torch.dtype,
                   device=None) -> torch.Tensor:
    """W + s B A for stacked experts `base` [E, out, in], rounded once to `out_dtype` (the module docstring);
    `base` may live in host memory."""
    w = base.to(device if device is not None else a.device, non_blocking=True)
    d = delta(a, b, scale, w.shape[0])
    return (w.to(d.dtype) + d).to(out_dtype)


class ExpertsDeltaFunction(torch.autograd.Function):
    """W' = round(W + s B_e A_e per expert), as a function of the adapters (A [r*E, in], B [out, r*E]).

    Forward: W' itself, as `merge` wrote it (the tensor the engine computes with; nothing is recomputed).
    Backward, taking the rounding of W' as the identity (the straight-through step of LoRALinearFunction), with
    G = dL/dW' [E, out, in] (the experts' weight gradient, bf16 on the GPU):
        dA_e = s B_e^T G_e    [r, in]      written to A's rows e*r .. e*r + r-1
        dB_e = s G_e A_e^T    [out, r]     written to B's columns e, E + e, ..., (r-1)*E + e
    as two batched products over the experts in float32 (float64 for float64 adapters); no gradient for W'.
    """

    @staticmethod
    def forward(ctx, weight, a, b, scale):
        ctx.save_for_backward(a, b)
        ctx.scale = scale
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        e = g.shape[0]
        cdt = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
        g = g.to(cdt)
        a3 = a.to(cdt).reshape(e, -1, a.shape[-1])                            # [E, r, in]
        b3 = b.to(cdt).reshape(b.shape[0], -1, e).permute(2, 0, 1)            # [E, out, r]
        da = torch.bmm(b3.transpose(1, 2), g) * ctx.scale                     # [E, r, in]
        db = torch.bmm(g, a3.transpose(1, 2)) * ctx.scale                     # [E, out, r]
        return None, da.reshape(a.shape).to(a.dtype), db.permute(1, 2, 0).reshape(b.shape).to(b.dtype), None


class LoRAExperts(nn.Module):
    """A sparse layer's experts computing with merged weights W' and training LoRA adapters on some of them.

    `weights`: {param: W'} (adopted, not copied: the engine's tensors), `base`: {param: frozen W}, for every
    name of PARAMS (the ones not in `targets` are frozen and have no adapters). A starts at PEFT's default for
    ParamWrapper (its nn.Linear(in, r*E): uniform in +-1/sqrt(in)), drawn from `generator`; B at zero."""

    def __init__(self, weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], targets: tuple[str, ...],
                 rank: int, scale: float, generator: torch.Generator | None = None, device=None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(weights["gate_up_proj"], requires_grad=False)
        self.down_proj = nn.Parameter(weights["down_proj"], requires_grad=False)
        self.num_experts = self.gate_up_proj.shape[0]
        self.blocks = [(t, 0, getattr(self, t).shape[1]) for t in PARAMS if t in targets]
        """[(param, 0, out)]: LoRALinear's interface (the adapted blocks; an expert parameter is one block)."""
        self.base = {t: base[t] for t, _, _ in self.blocks}
        self.scale = scale
        device = self.gate_up_proj.device if device is None else device
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for t, _, out in self.blocks:
            fan_in = getattr(self, t).shape[2]
            bound = 1.0 / math.sqrt(fan_in)
            a = torch.empty(rank * self.num_experts, fan_in, dtype=torch.float32).uniform_(-bound, bound,
                                                                                          generator=generator)
            self.lora_A[t] = nn.Parameter(a.to(device))
            self.lora_B[t] = nn.Parameter(torch.zeros(out, rank * self.num_experts, dtype=torch.float32,
                                                      device=device))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W13', W2') for the sparse block, differentiable in the adapters where they need a gradient."""
        out = []
        for t in PARAMS:
            w = getattr(self, t)
            if t in self.lora_A and torch.is_grad_enabled() and self.lora_A[t].requires_grad:
                w = ExpertsDeltaFunction.apply(w, self.lora_A[t], self.lora_B[t], self.scale)
            out.append(w)
        return out[0], out[1]

    @torch.no_grad()
    def merge(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """W' = round(W + s B A) for every adapted parameter, from this module's adapters or from `adapters`
        ({param: (A, B)}: another policy's, e.g. the reference's)."""
        for t, _, _ in self.blocks:
            a, b = adapters[t] if adapters is not None else (self.lora_A[t], self.lora_B[t])
            w = getattr(self, t)
            w.copy_(merged_experts(self.base[t], a, b, self.scale, w.dtype, w.device))
