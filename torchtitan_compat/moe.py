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

from functools import partial

import torch
from torch import nn

import batch_invariant_backward as bib
from batch_invariant_backward import _mm, compute_dtype


def _expert_order(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, counts): the (token, slot) rows t*k + j grouped by expert with a stable sort (order: expert, then t,
    then j), and the rows each expert took, counts [E] (on the device). Every reduction over an expert's rows
    follows this order, never the order of vLLM's atomically built `sorted_token_ids`."""
    flat = ids.reshape(-1).long()
    return torch.sort(flat, stable=True).indices, torch.bincount(flat, minlength=num_experts)


def _segments(counts: torch.Tensor) -> list[tuple[int, slice]]:
    """(expert, its rows of perm) for every expert that took some (the counts read on the host)."""
    ends = counts.cumsum(0).tolist()
    starts = [0] + ends[:-1]
    return [(e, slice(a, b)) for e, (a, b) in enumerate(zip(starts, ends)) if b > a]


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


GROUPED_BACKWARD = True
"""ExpertsFunction's backward runs as grouped GEMMs wherever `grouped_backward_runs` allows; False forces the
per-expert loop everywhere (compare/bench_trainer.py times both, tests/gpu/test_moe_ops.py compares them)."""


def grouped_backward_runs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """True where ExpertsFunction's backward takes the grouped path: GROUPED_BACKWARD on, torch has `_grouped_mm`,
    CUDA tensors on a GPU of compute capability 9.x or 10.x (the GPUs torch builds its CUTLASS bf16 grouped kernel
    for; on others it would loop over the groups itself), x and both weights bf16, the weights contiguous at
    16-byte aligned addresses, and D and I multiples of 8 (rows of 16 bytes: the kernel's TMA loads need 16-byte
    aligned strides and group starts)."""
    if not (GROUPED_BACKWARD and hasattr(torch, "_grouped_mm") and x.is_cuda):
        return False
    if any(t.dtype != torch.bfloat16 for t in (x, w13, w2)) or x.shape[-1] % 8 or w2.shape[-1] % 8:
        return False
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (w13, w2)):
        return False
    return torch.cuda.get_device_capability(x.device)[0] in (9, 10)


class ExpertsFunction(torch.autograd.Function):
    """y = backend.moe_experts(x, W13, W2, w, ids) (the module docstring's c1..y).

    Backward, per (token t, slot j) row with expert e, a = c2[t, j], dy = dL/dy_t:
        v      = dy W2[e]                      [I]     (the down GEMM's input gradient, before the weight)
        dw_tj  = <v, a>                                (fp32 over I)
        da     = w_tj v
        dc1    = SwiGLU backward of c1[t, j] at da     (bib.SiluAndMulFunction's math)
        dx_t   = sum_j dc1 W13[e]                      (per slot, then summed over j in slot order, fp32)
        dW2[e] = sum over e's rows of (w dy)^T a,  dW13[e] = sum over e's rows of dc1^T x_t
    The T*k rows are sorted by expert with a stable sort (`_expert_order`), so expert e owns one contiguous block
    of rows r_e, and the GEMMs come in two pairs (`experts_backward`), each a row product and a weight product:
        V[r_e] = dY[r_e] W2[e],      dW2[e]  = (w dY)[r_e]^T A[r_e]
        G[r_e] = dC1[r_e] W13[e],    dW13[e] = dC1[r_e]^T X[r_e]        (dx_t = sum over j of G at row (t, j))
    Results go back to distinct rows (no atomics, no index_add); an expert without rows gets dW = 0.

    Two paths compute the pairs, the same math:
      grouped (`grouped_backward_runs`: CUDA, bf16, compute capability 9.x/10.x) - each product is one
        torch._grouped_mm call over all experts, as torchtitan 0.2.2's MoE calls it: 2D x 3D with
        offs = cumsum(counts) for the row products, 2D x 2D with the same offs (the contraction split by expert)
        for the weight products. bf16 operands, fp32 accumulation, one rounding to bf16. torch only lets it
        return its input dtype, so V and G are rounded to bf16 where the loop keeps them in fp32: one extra
        rounding of relative size <= u = 2^-8 (bf16's unit roundoff) per element, before the fp32 dot <V, A>, the
        fp32 product w V and the fp32 slot sum; the weight gradients are rounded once, as on the loop. Every
        gradient moves by about u norm-wise (measured on the CPU at Qwen3-30B-A3B's layer shapes, T = 1 and 300:
        <= 4.3e-3 of its norm). No padding: each group starts at
        row offs[e-1] of a row-major operand whose rows are D, I or 2I bf16 elements (multiples of 16 bytes), so
        every group start is 16-byte aligned whatever the counts, which is all the kernel's TMA loads need.
        Deterministic: torch's CUTLASS grouped GEMM (aten/src/ATen/native/cuda/GroupMM.cu) has every output tile
        computed by one thread block running the whole contraction in a fixed order (warp-specialized
        persistent kernel: no split-K, no stream-K, no atomics), with the tile shape chosen from the shapes
        (mean rows per expert, N, K) and the GPU's architecture, never from the values: the same inputs give the
        same bits.
      loop (everywhere else: CPU, float32 and float64 - the CPU gradcheck tests the math through it -, fp16,
        other GPUs, a torch without _grouped_mm, GROUPED_BACKWARD = False) - two GEMMs per expert that took
        rows (`_mm`: on tensor cores bf16 operands, V and G kept as the unrounded fp32 accumulator).
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
        grouped = grouped_backward_runs(x, w13, w2)
        weight_grads = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        return (*experts_backward(dy, x, w13, w2, w, ids, c1, ctx.backend, grouped, weight_grads), None, None)


def experts_backward(dy, x, w13, w2, w, ids, c1, backend, grouped: bool, weight_grads: bool = True):
    """(dx, dW13, dW2, dw) of ExpertsFunction (its docstring's math) at dy = dL/dy; `grouped`: the GEMM pairs as
    torch._grouped_mm calls (`_grouped_gemms`), else the per-expert loop (`_loop_gemms`). Without `weight_grads`
    (frozen experts: LoRA on attention only) the weight products are skipped and dW13 = dW2 = None."""
    t, k = ids.shape
    cdt = compute_dtype(x.dtype)
    perm, counts = _expert_order(ids, w13.shape[0])
    if grouped:
        gemms = partial(_grouped_gemms, counts.cumsum(0).to(torch.int32), (counts == 0).nonzero()[:, 0],
                        weight_grads)
    else:
        gemms = partial(_loop_gemms, _segments(counts), weight_grads)
    tok = perm // k
    c1s = c1[perm]
    a = backend.silu_and_mul(c1s)
    dys, xs = dy[tok].contiguous(), x[tok].contiguous()
    ws = w.reshape(-1)[perm].to(cdt)[:, None]
    wdy = (dys.to(cdt) * ws).to(x.dtype)
    v, dw2 = gemms(dys, w2, wdy, a, cdt)
    dw = torch.empty(t * k, dtype=cdt, device=x.device)
    dw[perm] = (v * a.to(cdt)).sum(-1)
    dc1 = bib.silu_and_mul_grad(c1s, (v * ws).to(x.dtype))
    g, dw13 = gemms(dc1, w13, dc1, xs, cdt)
    g_slots = torch.empty_like(g)
    g_slots[perm] = g
    g_slots = g_slots.view(t, k, -1)
    dx = g_slots[:, 0]
    for j in range(1, k):
        dx = dx + g_slots[:, j]
    return dx.to(x.dtype), dw13, dw2, dw.view(t, k).to(w.dtype)


def _loop_gemms(segments, weight_grads, rows, weight, left, right, cdt):
    """out[r] = rows[r] weight[e] in the compute dtype and dW[e] = left[r]^T right[r] in the weight's dtype, for
    every (expert e, its rows r) of `segments`; dW[e] = 0 for the experts not in it (dW = None without
    `weight_grads`). Two `_mm` calls per expert."""
    out = torch.empty((rows.shape[0], weight.shape[-1]), dtype=cdt, device=rows.device)
    dweight = torch.zeros_like(weight) if weight_grads else None
    for e, r in segments:
        out[r] = _mm(rows[r], weight[e], cdt)
        if weight_grads:
            dweight[e] = _mm(left[r].t(), right[r], weight.dtype)
    return out, dweight


def _grouped_gemms(offs, idle, weight_grads, rows, weight, left, right, cdt):
    """`_loop_gemms`' two products, each one torch._grouped_mm call over all experts (offs: each expert's end row,
    int32; idle: the experts without rows, whose dW is set to 0 - a group with an empty contraction is not written
    by every GPU's kernel, pytorch/pytorch#172439). The row product comes back rounded to the operands' dtype
    (torch's constraint), then in the compute dtype."""
    out = torch._grouped_mm(rows.contiguous(), weight, offs=offs).to(cdt)
    if not weight_grads:
        return out, None
    dweight = torch._grouped_mm(left.contiguous().t(), right.contiguous(), offs=offs)
    return out, dweight.index_fill_(0, idle, 0)


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

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W13, W2) the sparse block computes with (LoRAExperts: the merged ones, differentiable in the adapters)."""
        return self.gate_up_proj, self.down_proj


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
        return experts(x, *self.experts.weights(), w, ids, p.backend)


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
