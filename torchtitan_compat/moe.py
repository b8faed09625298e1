"""Qwen3-MoE's sparse block, computed as vLLM 0.26.0's batch-invariant engine computes it, with a
deterministic backward.

One sparse layer, T tokens, E experts, top-k, hidden D, expert width I (docs/vllm-0.26-moe-path.md):

    z   = x Wg^T                                  router logits, [T, E], the dense linear op (`bib.linear`)
    w, ids = route(z)                             softmax over E in fp32; the k largest (ties: lower expert
                                                  index first; slots by descending p); renormalized as
                                                  w = p * (1 / S), S summed in slot order       [T, k]
    c1  = x_t W13[e]^T       for each (t, j)      gate|up GEMM,  [T*k, 2I]  (W13 [E, 2I, D])
    c2  = silu(c1[:, :I]) * c1[:, I:]             [T*k, I]
    c3  = (c2 W2[e]^T) * w_tj                     down GEMM, the weight applied in fp32 before the one
                                                  rounding,      [T*k, D]   (W2 [E, D, I])
    y_t = sum_j c3[t, j]                          fp32, slots in order 0..k-1, one rounding

The two forward ops are the kernel backend's (`moe_route`, `moe_experts`: vLLM's own kernels on the
`vllm` backend, plain PyTorch on `reference`); this module adds their gradients. `ids` are recorded
per layer when the model is asked for its routes (`routes`), so that parity can compare them with
the engine's.
"""

from __future__ import annotations

import torch
from torch import nn

import batch_invariant_backward as bib
from batch_invariant_backward import _mm, compute_dtype


def _expert_segments(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[tuple[int, slice]]]:
    """(perm, segments): the (token, slot) rows t*k + j grouped by expert with a stable sort (order: expert,
    then t, then j), and (expert, its rows of perm) for every expert that took some. Every reduction over an
    expert's rows follows this order, never the order of vLLM's atomically built `sorted_token_ids`."""
    flat = ids.reshape(-1).long()
    perm = torch.sort(flat, stable=True).indices
    ends = torch.bincount(flat, minlength=num_experts).cumsum(0).tolist()
    starts = [0] + ends[:-1]
    return perm, [(e, slice(a, b)) for e, (a, b) in enumerate(zip(starts, ends)) if b > a]


class RouteFunction(torch.autograd.Function):
    """(w, ids) = backend.moe_route(z, k, renormalize); z [T, E] router logits.

    Forward: p = softmax(z) over E (fp32); ids = the k largest p (piecewise constant: no gradient);
    renormalized, w_j = p_{e_j} / S with S = sum_j p_{e_j}, i.e. a softmax over the k chosen logits;
    else w_j = p_{e_j}.
    Backward, with g = dL/dw:
        renormalized:  dz_{e_j} = w_j (g_j - sum_i w_i g_i),  dz = 0 for the experts not chosen
        else:          dz_m = p_m (g~_m - sum_j w_j g_j),  g~_m = g_j if m = e_j else 0 (over all E)
    Per-row reductions of k terms in slot order; scatters write k distinct columns of a row.
    """

    @staticmethod
    def forward(ctx, z, top_k, renormalize, backend):
        w, ids = backend.moe_route(z, top_k, renormalize)
        ctx.save_for_backward(z, w, ids)
        ctx.renormalize = renormalize
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx, grad_w, _grad_ids):
        z, w, ids = ctx.saved_tensors
        cdt = compute_dtype(z.dtype)
        g, wc, cols = grad_w.to(cdt), w.to(cdt), ids.long()
        dot = (wc * g).sum(-1, keepdim=True)
        if ctx.renormalize:
            dz = torch.zeros(z.shape, dtype=cdt, device=z.device).scatter_(-1, cols, wc * (g - dot))
        else:
            p = torch.softmax(z.to(cdt), -1)
            dz = p * (torch.zeros_like(p).scatter_(-1, cols, g) - dot)
        return dz.to(z.dtype), None, None, None


class ExpertsFunction(torch.autograd.Function):
    """y = backend.moe_experts(x, W13, W2, w, ids) (the module docstring's c1..y).

    Backward, per (token t, slot j) row with expert e, a = c2[t, j], dy = dL/dy_t:
        v      = dy W2[e]                      [I]     (the down GEMM's input gradient, before the weight)
        dw_tj  = <v, a>                                (fp32 over I)
        da     = w_tj v
        dc1    = SwiGLU backward of c1[t, j] at da     (bib.SiluAndMulFunction's math)
        dx_t   = sum_j dc1 W13[e]                      (per slot, then summed over j in slot order, fp32)
        dW2[e] = sum over e's rows of (w dy)^T a,  dW13[e] = sum over e's rows of dc1^T x_t
    Rows are grouped by expert with a stable sort (`_expert_segments`); each expert's GEMMs run over
    its rows in that order; results are written back to distinct rows (no atomics, no index_add).
    """

    @staticmethod
    def forward(ctx, x, w13, w2, w, ids, backend):
        y, c1 = backend.moe_experts(x, w13, w2, w, ids)
        ctx.save_for_backward(x, w13, w2, w, ids, c1)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w13, w2, w, ids, c1 = ctx.saved_tensors
        t, k = ids.shape
        perm, segments = _expert_segments(ids, w13.shape[0])
        cdt = compute_dtype(x.dtype)
        tok = perm // k
        c1s = c1[perm]
        a = ctx.backend.silu_and_mul(c1s)
        dys, xs = dy[tok].contiguous(), x[tok].contiguous()
        ws = w.reshape(-1)[perm].to(cdt)[:, None]
        wdy = (dys.to(cdt) * ws).to(x.dtype)
        v = torch.empty(a.shape, dtype=cdt, device=x.device)
        dw13, dw2 = torch.zeros_like(w13), torch.zeros_like(w2)
        for e, r in segments:
            v[r] = _mm(dys[r], w2[e], cdt)
            dw2[e] = _mm(wdy[r].t(), a[r], w2.dtype)
        dw = torch.empty(t * k, dtype=cdt, device=x.device)
        dw[perm] = (v * a.to(cdt)).sum(-1)
        dc1 = bib.silu_and_mul_grad(c1s, (v * ws).to(x.dtype))
        dxs = torch.empty((t * k, x.shape[1]), dtype=cdt, device=x.device)
        for e, r in segments:
            dxs[r] = _mm(dc1[r], w13[e], cdt)
            dw13[e] = _mm(dc1[r].t(), xs[r], w13.dtype)
        dx_slots = torch.empty_like(dxs)
        dx_slots[perm] = dxs
        dx_slots = dx_slots.view(t, k, -1)
        dx = dx_slots[:, 0]
        for j in range(1, k):
            dx = dx + dx_slots[:, j]
        return dx.to(x.dtype), dw13, dw2, dw.view(t, k).to(w.dtype), None, None


def route(z, top_k: int, renormalize: bool, backend):
    """(w [T, k], ids int32 [T, k]) of router logits z [T, E]."""
    if not bib._needs_grad(z):
        return backend.moe_route(z, top_k, renormalize)
    return RouteFunction.apply(z, top_k, renormalize, backend)


def experts(x, w13, w2, w, ids, backend):
    """sum_j w_tj * MLP_{ids[t, j]}(x_t), [T, D]."""
    if not bib._needs_grad(x, w13, w2, w):
        return backend.moe_experts(x, w13, w2, w, ids)[0]
    return ExpertsFunction.apply(x, w13, w2, w, ids, backend)


class Experts(nn.Module):
    """The experts' weights in vLLM's FusedMoE layout (and transformers 5's): gate_up_proj [E, 2I, D] = each
    expert's cat(gate, up); down_proj [E, D, I]."""

    def __init__(self, num_experts: int, dim: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, inter))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)


class MoE(nn.Module):
    """Qwen3-MoE's sparse block: router -> top-k -> experts -> weighted combine (no shared expert)."""

    def __init__(self, a, layer_id: int, linear_cls):
        super().__init__()
        self.layer_id = layer_id
        self.top_k, self.renormalize = a.moe_args.top_k, bool(a.moe_args.route_norm)
        self.router = linear_cls(a.dim, a.moe_args.num_experts)
        self.experts = Experts(a.moe_args.num_experts, a.dim, a.moe_inter_dim)

    def forward(self, x: torch.Tensor, p) -> torch.Tensor:
        z = self.router(x, p)
        w, ids = route(z, self.top_k, self.renormalize, p.backend)
        if p.routes is not None:
            p.routes[self.layer_id] = ids
        if p.router_logits is not None:
            p.router_logits[self.layer_id] = z
        return experts(x, self.experts.gate_up_proj, self.experts.down_proj, w, ids, p.backend)


def load_balancing_loss(router_logits: list[torch.Tensor], ids: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """transformers' Qwen3-MoE `load_balancing_loss_func` without padding, over the L sparse layers' router logits
    z_l [N, E] and the experts the tokens took, ids_l [N, k] (the engine's, which transformers would recompute with
    its own top-k of softmax(z)):

        p = softmax(z) over E for the L*N rows;  f[j, e] = mean over rows of [ids[:, j] == e]  [k, E]
        P[e] = mean over rows of p[:, e];        aux = E * sum_{j, e} f[j, e] P[e]

    (f sums to k over (j, e): a balanced router gives aux = k). Differentiable through P only, as transformers' is.
    The softmax is taken in float32 (transformers takes it in the logits' dtype)."""
    z = torch.cat(router_logits).float()
    p = torch.softmax(z, dim=-1)
    chosen = torch.nn.functional.one_hot(torch.cat(ids).long(), num_experts)  # [L*N, k, E]
    tokens_per_expert = chosen.float().mean(0)
    return (tokens_per_expert * p.mean(0)[None]).sum() * num_experts
