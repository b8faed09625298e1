"""Qwen3VLLMCompatModel: torchtitan's Qwen3, laid out and computed the way vLLM computes it.

Same math as torchtitan's `Qwen3Model` (pre-norm decoder, q/k RMSNorm per head, neox RoPE, GQA,
SwiGLU MLP, tied or untied embeddings; Qwen3-MoE's sparse layers from `moe.py`), with vLLM's merged
projections (`qkv_proj` = [wq; wk; wv], `gate_up_proj` = [w1; w3]) so that every matmul has the very
shape vLLM runs, and every op routed through a kernel backend (`ops.py`) wrapped with a backward
(`batch_invariant_backward.py`). LoRA (`lora.py`) swaps adapted projections for `LoRALinear`s,
which compute with the merged weight and train the adapters.

Input is vLLM's flat token batch: sequences packed along one axis, described by `cu_seqlens`.
The residual stream is added in the activation dtype before each RMSNorm, exactly as vLLM's
layers do after `vllm_patches` replaced its fused add+norm kernel.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchtitan.models.qwen3 import Qwen3ModelArgs

import batch_invariant_backward as bib

from .config import sparse_layers
from .lora import LoRALinear
from .moe import MoE
from .ops import select_backend


class LayerRecord(MutableMapping):
    """Layer id -> tensor, filled by a forward (Qwen3-MoE's routes or router logits). Not a dict on purpose: FSDP2's
    forward hooks rebuild dict arguments (to cast their tensors), which would leave the caller's dict empty."""

    def __init__(self):
        self._by_layer: dict = {}

    def __getitem__(self, key):
        return self._by_layer[key]

    def __setitem__(self, key, value):
        self._by_layer[key] = value

    def __delitem__(self, key):
        del self._by_layer[key]

    def __iter__(self):
        return iter(self._by_layer)

    def __len__(self):
        return len(self._by_layer)


@dataclass
class Packed:
    """Per-forward metadata shared by all layers."""

    positions: torch.Tensor  # int64 [T], position of each token inside its sequence
    cu_seqlens: torch.Tensor  # int32 [B+1]
    max_seqlen: int
    rope_cache: torch.Tensor  # [max_positions, head_dim] = [cos | sin]
    backend: object
    routes: dict | None = None  # sparse layer id -> int32 [T, k] expert ids, filled when asked for
    router_logits: dict | None = None  # sparse layer id -> [T, E] router logits, filled when asked for


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, p: Packed) -> torch.Tensor:
        return bib.rms_norm(x, self.weight, self.eps, p.backend)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor, p: Packed) -> torch.Tensor:
        return bib.linear(x, self.weight, p.backend)


class Attention(nn.Module):
    def __init__(self, a: Qwen3ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.qkv_proj = Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim)
        self.o_proj = Linear(a.n_heads * a.head_dim, a.dim)
        self.q_norm = Norm(a.head_dim, a.norm_eps)
        self.k_norm = Norm(a.head_dim, a.norm_eps)

    def forward(self, x: torch.Tensor, p: Packed) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x, p).split(
            [self.n_heads * d, self.n_kv_heads * d, self.n_kv_heads * d], dim=-1)
        # q_norm, k_norm then RoPE as one op (one Triton pass on the vllm backend); both norms were
        # built with the model's norm_eps, so one eps serves both
        q, k = bib.qk_norm_rope(p.positions, q.view(t, self.n_heads, d), k.view(t, self.n_kv_heads, d),
                                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, p.rope_cache, p.backend)
        v = v.reshape(t, self.n_kv_heads, d)
        o = bib.attention(q, k, v, p.cu_seqlens, p.max_seqlen, d ** -0.5, p.backend)
        return self.o_proj(o.reshape(t, self.n_heads * d), p)


class FeedForward(nn.Module):
    def __init__(self, a: Qwen3ModelArgs):
        super().__init__()
        self.gate_up_proj = Linear(a.dim, 2 * a.hidden_dim)
        self.down_proj = Linear(a.hidden_dim, a.dim)

    def forward(self, x: torch.Tensor, p: Packed) -> torch.Tensor:
        return self.down_proj(bib.silu_and_mul(self.gate_up_proj(x, p), p.backend), p)


class DecoderLayer(nn.Module):
    """Attention, then the dense MLP (`feed_forward`) or, in a Qwen3-MoE sparse layer, the experts (`moe`)."""

    def __init__(self, a: Qwen3ModelArgs, layer_id: int):
        super().__init__()
        self.attention_norm = Norm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = Norm(a.dim, a.norm_eps)
        if layer_id in sparse_layers(a):
            self.moe = MoE(a, layer_id, Linear)
        else:
            self.feed_forward = FeedForward(a)

    def forward(self, h: torch.Tensor, p: Packed) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h, p), p)
        mlp = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + mlp(self.ffn_norm(h, p), p)


class Qwen3VLLMCompatModel(nn.Module):
    """Qwen3 causal LM over packed sequences; `forward` returns logits [T, vocab]."""

    def __init__(self, model_args: Qwen3ModelArgs, backend: str | object = "auto"):
        super().__init__()
        self.args = model_args
        self.backend = select_backend(backend, model_args=model_args) if isinstance(backend, str) else backend
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        self.layers = nn.ModuleList(DecoderLayer(model_args, i) for i in range(model_args.n_layers))
        self.norm = Norm(model_args.dim, model_args.norm_eps)
        self.output = None if model_args.enable_weight_tying else Linear(model_args.dim, model_args.vocab_size)
        self._rope_cache: torch.Tensor | None = None
        self.activation_checkpointing = False
        """Keep only each decoder layer's input when grad is on; recompute the layer in the
        backward (every op is deterministic, so the recomputation has the forward's bits)."""

    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def head_lora(self):
        """(A, B, scale) of a LoRA adapter on lm_head (torchtitan_compat.lora), else None."""
        return self.output.head_lora() if isinstance(self.output, LoRALinear) else None

    def rope_cache(self, like: torch.Tensor) -> torch.Tensor:
        """vLLM's [cos | sin] table, built once per device/dtype (not a parameter, never trained)."""
        c = self._rope_cache
        if c is None or c.device != like.device or c.dtype != like.dtype:
            c = self.backend.rope_cache(self.args.head_dim, self.args.max_seq_len,
                                        self.args.rope_theta, like.dtype, like.device)
            self._rope_cache = c
        return c

    def packed(self, positions, cu_seqlens, max_seqlen=None, like=None, routes=None, router_logits=None) -> Packed:
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return Packed(positions, cu_seqlens, max_seqlen, self.rope_cache(like), self.backend, routes, router_logits)

    def hidden_states(self, tokens, positions, cu_seqlens, max_seqlen=None, routes=None,
                      router_logits=None) -> torch.Tensor:
        """The final norm's output [T, D]. `routes` / `router_logits`: mappings (a LayerRecord under FSDP2) that each
        sparse layer fills with its expert ids int32 [T, k] / its router logits [T, E] (Qwen3-MoE; parity, the aux
        loss)."""
        h = self.tok_embeddings(tokens)
        p = self.packed(positions, cu_seqlens, max_seqlen, like=h, routes=routes, router_logits=router_logits)
        checkpointing = self.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            h = checkpoint(layer, h, p, use_reentrant=False) if checkpointing else layer(h, p)
        return self.norm(h, p)

    def forward(self, tokens, positions, cu_seqlens, max_seqlen=None) -> torch.Tensor:
        h = self.hidden_states(tokens, positions, cu_seqlens, max_seqlen)
        if isinstance(self.output, LoRALinear):
            return self.output.apply(h, self.backend)
        return bib.linear(h, self.output_weight(), self.backend)

    def token_logprobs(self, tokens, positions, cu_seqlens, max_seqlen, rows, targets, temperature=1.0,
                       min_p=0.0, entropy=False, routes=None, router_logits=None):
        """float32 logprob of targets[i] under row rows[i]'s distribution (logits / temperature, then
        min-p), and its entropy when asked: ([N], [N] or None). Only the selected rows go through
        lm_head (every op after the decoder is row-wise, so selecting first changes no bits). One
        call is one forward, so a sharded model (FSDP2) gathers its weights for it as for forward.
        `routes` / `router_logits`: dicts the sparse layers fill (see hidden_states)."""
        h = self.hidden_states(tokens, positions, cu_seqlens, max_seqlen, routes=routes,
                               router_logits=router_logits)[rows]
        return bib.lm_head_logprobs(h, self.output_weight(), targets, self.backend, temperature, min_p,
                                    entropy=entropy, lora=self.head_lora())
