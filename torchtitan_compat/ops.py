"""The kernel-backend layer: every op whose output must match vLLM's goes through here.

Two backends implement the same small interface (forward only; gradients are added by
`batch_invariant_backward.py`):

* `reference` - plain PyTorch. Runs anywhere; what the CPU test suite proves against
  Hugging Face `transformers`.
* `vllm` - vLLM 0.26.0's own kernels and ops (batch-invariant Triton matmul and RMSNorm, its
  CUDA SiLU-and-mul and rotary, FlashAttention 3 varlen with num_splits=1). Only on CUDA with
  vLLM importable and `VLLM_BATCH_INVARIANT=1`.

`select_backend("auto")` picks `vllm` on CUDA and `reference` on CPU and logs the choice. On a
CUDA device it never falls back silently: if vLLM is missing, it raises and says how to ask
for `reference` explicitly.

Tensor conventions (flat token layout, as in vLLM):
    x: [T, K] activations; weight: [N, K]; positions: int64 [T]
    q: [T, Hq, D], k/v: [T, Hk, D]; cu_seqlens: int32 [B+1]
    qk_norm_rope(positions, q, k, q_weight [D], k_weight [D], eps, cos_sin_cache) returns new
        (q, k): rotary(rms_norm(q) * q_weight, rms_norm(k) * k_weight); q and k may be views
    attention returns (out [T, Hq, D], lse float32 [Hq, T])
    token_logprobs(logits [T, V], ids int64 [T]) returns float32 [T]
    sampling_logits(logits [T, V], temperature, min_p) returns new [T, V] logits, same dtype: the
        distribution the sampler draws from (logits / T, then min-p), as vLLM's sampler computes it
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from batch_invariant_backward import compute_dtype

from . import attention as ref_attention
from .backend_base import BackendError, norm_then_rotary

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "reference", "vllm")


class ReferenceBackend:
    """Plain-PyTorch ops with vLLM's numerics conventions (float32 RMSNorm statistics, neox RoPE)."""

    name = "reference"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float() if x.dtype != torch.float64 else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return y.to(x.dtype) * weight

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)

    def rope_cache(self, head_dim: int, max_positions: int, theta: float, dtype, device):
        """[max_positions, head_dim] = [cos | sin] of position * theta^(-2i/D), as vLLM builds it."""
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        t = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)

    def rotary(self, positions, q, k, cos_sin_cache):
        """Neox-style rotation of q [T, Hq, D] and k [T, Hk, D]; returns new tensors."""
        cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)  # [T, D/2] each
        return rotate_neox(q, cos, sin), rotate_neox(k, cos, sin)

    def qk_norm_rope(self, positions, q, k, q_weight, k_weight, eps: float, cos_sin_cache):
        return norm_then_rotary(self, positions, q, k, q_weight, k_weight, eps, cos_sin_cache)

    def attention(self, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
        return ref_attention.varlen_causal_attention(q, k, v, cu_seqlens, scale)

    def moe_route(self, z: torch.Tensor, top_k: int, renormalize: bool):
        """vLLM's topk_softmax: p = softmax(z) in the compute dtype; the top_k largest, ties to the lower expert
        index, slots by descending p (a stable sort); renormalized: w = p * (1 / S), S summed in slot order.
        Returns (w [T, k] in the compute dtype, ids int32 [T, k])."""
        p = torch.softmax(z.to(compute_dtype(z.dtype)), -1)
        ids = torch.sort(-p, dim=-1, stable=True).indices[:, :top_k]
        w = p.gather(-1, ids)
        if renormalize:
            s = w[:, 0]
            for j in range(1, top_k):
                s = s + w[:, j]
            w = w * (1.0 / s)[:, None]
        return w, ids.to(torch.int32)

    def moe_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w: torch.Tensor, ids: torch.Tensor):
        """(y [T, D], c1 [T*k, 2I]) of the sparse block (torchtitan_compat/moe.py): each GEMM in the compute dtype
        then rounded once, the routing weight applied before the down GEMM's rounding, slots summed in order."""
        t, k = ids.shape
        cdt = compute_dtype(x.dtype)
        flat = ids.reshape(-1).long()
        groups = [(e, (flat == e).nonzero()[:, 0]) for e in flat.unique().tolist()]  # each expert's (token, slot) rows
        c1 = torch.empty((t * k, w13.shape[1]), dtype=x.dtype, device=x.device)
        c3 = torch.empty((t * k, w2.shape[1]), dtype=x.dtype, device=x.device)
        for e, rows in groups:
            c1[rows] = (x[rows // k].to(cdt) @ w13[e].to(cdt).t()).to(x.dtype)
        c2 = self.silu_and_mul(c1)
        wf = w.reshape(-1).to(cdt)
        for e, rows in groups:
            c3[rows] = ((c2[rows].to(cdt) @ w2[e].to(cdt).t()) * wf[rows, None]).to(x.dtype)
        c3 = c3.view(t, k, -1)
        y = c3[:, 0].to(cdt)
        for j in range(1, k):
            y = y + c3[:, j].to(cdt)
        return y.to(x.dtype), c1

    def token_logprobs(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """float32 log softmax(logits)[t, ids[t]] (float64 for float64 logits)."""
        z = logits if logits.dtype == torch.float64 else logits.float()
        return torch.log_softmax(z, -1).gather(-1, ids[:, None]).squeeze(-1)

    def sampling_logits(self, logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
        """vLLM's V2 sampler order: z = logits / T computed in float32 and stored back in the logits'
        dtype (skipped at T = 1), then min-p: entries below max(z) + log(min_p) become -inf."""
        cdt = compute_dtype(logits.dtype)
        z = logits
        if temperature != 1.0:
            z = (logits.to(cdt) / torch.tensor(temperature, dtype=cdt)).to(logits.dtype)
        if min_p > 0.0:
            threshold = z.max(-1, keepdim=True).values.to(cdt) + math.log(min_p)
            z = z.masked_fill(z.to(cdt) < threshold, float("-inf"))
        return z


def rotate_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D/2]. First half x1, second half x2 of each head:
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str = "auto", device: torch.device | str | None = None, model_args=None):
    """Return the kernel backend `name` for `device`, logging which one is in use. `model_args`: the model's, so that
    the vllm backend computes logprobs as the sampler of the runner vLLM gives that model (`vllm_ops.vllm_runner`)."""
    if name not in BACKEND_NAMES:
        raise BackendError(f"unknown kernel backend {name!r}; choose one of {BACKEND_NAMES}")
    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if name == "auto":
        if not on_cuda:
            name = "reference"
        elif vllm_available():
            name = "vllm"
        else:
            raise BackendError(
                "CUDA device but vLLM is not importable: install the gpu extra (vllm==0.26.0), "
                "or pass backend='reference' to run plain PyTorch ops (no parity with vLLM)"
            )
    if name == "vllm":
        from .vllm_ops import VLLMBackend, vllm_runner

        backend = VLLMBackend(sampler=vllm_runner(model_args))
    else:
        backend = ReferenceBackend()
    log.info("kernel backend: %s (device=%s)", backend.name, "cuda" if on_cuda else "cpu")
    return backend
