"""TorchTitan <-> our merged "vLLM-compat" layout <-> the HF names vLLM's `load_weights` takes.

The vLLM-compatible trainer model (torchtitan_compat/model.py) fuses projections the way vLLM's
Qwen3 does, so its matmuls have vLLM's shapes:

    tok_embeddings.weight                       [V, D]
    layers.{i}.attention_norm.weight            [D]
    layers.{i}.attention.qkv_proj.weight        [(Hq + 2 Hkv) Dh, D]  = cat([wq, wk, wv], 0)
    layers.{i}.attention.o_proj.weight          [D, Hq Dh]            = wo
    layers.{i}.attention.q_norm.weight          [Dh]
    layers.{i}.attention.k_norm.weight          [Dh]
    layers.{i}.ffn_norm.weight                  [D]
    layers.{i}.feed_forward.gate_up_proj.weight [2 I, D]              = cat([w1, w3], 0)
    layers.{i}.feed_forward.down_proj.weight    [D, I]                = w2
    norm.weight                                 [D]
    output.weight                               [V, D]  only when embeddings are untied

A Qwen3-MoE sparse layer has, in place of `feed_forward.*` (vLLM's FusedMoE layout, transformers 5's too):

    layers.{i}.moe.router.weight                [E, D]                = HF mlp.gate
    layers.{i}.moe.experts.gate_up_proj         [E, 2 I, D]           [e] = cat([gate_e, up_e], 0)
    layers.{i}.moe.experts.down_proj            [E, D, I]             [e] = down_e

Concatenation and splitting only move bytes, so every round trip is bit-exact. Splits return
views into the merged tensor (no copy) unless `clone=True`, which gives independent tensors that
can be modified without touching the fused weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from torchtitan_compat import Qwen3VLLMCompatModel, select_backend
from torchtitan_compat.config import ModelDir, sparse_layers
from weights import (WeightsError, check_state_dict, compat_experts_to_hf, expected_hf_expert_shapes,
                     expected_hf_shapes, hf_experts_to_compat,
                     expected_titan_shapes, hf_names_of_titan, hf_state_dict, hf_to_titan, read_model_dir, titan_to_hf)

_HINT = "the weights do not match the model config"


def _dims(model_args) -> tuple[int, int, int]:
    """(rows of wq, rows of wk == rows of wv, FFN hidden size)."""
    return model_args.n_heads * model_args.head_dim, model_args.n_kv_heads * model_args.head_dim, model_args.hidden_dim


def linear_shapes(model_args) -> dict[str, tuple[int, int]]:
    """(N, K) of each GEMM a forward runs, by name: the fused `qkv`, `o`, the fused `gate_up` and `down` (every
    decoder layer alike; the compat layout's weights), and `lm_head` (vocab x dim, tied or not)."""
    d = model_args.dim
    q, kv, inter = _dims(model_args)
    return {"qkv": (q + 2 * kv, d), "o": (d, q), "gate_up": (2 * inter, d), "down": (d, inter),
            "lm_head": (model_args.vocab_size, d)}


def expected_compat_expert_shapes(model_args) -> dict[str, tuple[int, ...]]:
    """Compat names -> shapes of the Qwen3-MoE sparse layers' router and experts."""
    a = model_args
    shapes = {}
    for i in sparse_layers(a):
        e, inter, p = a.moe_args.num_experts, a.moe_inter_dim, f"layers.{i}.moe."
        shapes.update({p + "router.weight": (e, a.dim), p + "experts.gate_up_proj": (e, 2 * inter, a.dim),
                       p + "experts.down_proj": (e, a.dim, inter)})
    return shapes


def expected_compat_shapes(model_args) -> dict[str, tuple[int, ...]]:
    """Compat-layout names -> shapes, in canonical order."""
    a = model_args
    d, dh = a.dim, a.head_dim
    lin = linear_shapes(a)
    moe = expected_compat_expert_shapes(a)
    shapes = {"tok_embeddings.weight": (a.vocab_size, d)}
    for i in range(a.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attention_norm.weight": (d,),
            p + "attention.qkv_proj.weight": lin["qkv"],
            p + "attention.o_proj.weight": lin["o"],
            p + "attention.q_norm.weight": (dh,),
            p + "attention.k_norm.weight": (dh,),
            p + "ffn_norm.weight": (d,),
        })
        if i in sparse_layers(a):
            shapes.update((k, v) for k, v in moe.items() if k.startswith(p))
        else:
            shapes.update({p + "feed_forward.gate_up_proj.weight": lin["gate_up"],
                           p + "feed_forward.down_proj.weight": lin["down"]})
    shapes["norm.weight"] = (d,)
    if not a.enable_weight_tying:  # tied: the model reuses tok_embeddings as the head
        shapes["output.weight"] = (a.vocab_size, d)
    return shapes


def titan_to_compat(titan_sd: dict, model_args) -> dict:
    """TorchTitan state dict -> compat layout (fused qkv and gate_up; tied: no output.weight)."""
    expected = expected_titan_shapes(model_args)
    if model_args.enable_weight_tying:
        # Titan models with tying carry output.weight as an alias of the embedding; it must agree.
        if "output.weight" in titan_sd:
            out, emb = titan_sd["output.weight"], titan_sd.get("tok_embeddings.weight")
            if emb is not None and out is not emb and not torch.equal(out, emb):
                raise WeightsError("TorchTitan state dict: embeddings are tied but output.weight differs from "
                                   "tok_embeddings.weight; use an untied config or drop output.weight")
            titan_sd = {k: v for k, v in titan_sd.items() if k != "output.weight"}
        expected = {k: v for k, v in expected.items() if k != "output.weight"}
    check_state_dict(titan_sd, expected, "TorchTitan state dict", _HINT)

    compat = {"tok_embeddings.weight": titan_sd["tok_embeddings.weight"]}
    for i in range(model_args.n_layers):
        t = c = f"layers.{i}."  # same prefix in both layouts
        compat[c + "attention_norm.weight"] = titan_sd[t + "attention_norm.weight"]
        compat[c + "attention.qkv_proj.weight"] = torch.cat(
            [titan_sd[t + "attention.wq.weight"], titan_sd[t + "attention.wk.weight"], titan_sd[t + "attention.wv.weight"]], 0)
        compat[c + "attention.o_proj.weight"] = titan_sd[t + "attention.wo.weight"]
        compat[c + "attention.q_norm.weight"] = titan_sd[t + "attention.q_norm.weight"]
        compat[c + "attention.k_norm.weight"] = titan_sd[t + "attention.k_norm.weight"]
        compat[c + "ffn_norm.weight"] = titan_sd[t + "ffn_norm.weight"]
        if i in sparse_layers(model_args):
            continue
        compat[c + "feed_forward.gate_up_proj.weight"] = torch.cat(
            [titan_sd[t + "feed_forward.w1.weight"], titan_sd[t + "feed_forward.w3.weight"]], 0)
        compat[c + "feed_forward.down_proj.weight"] = titan_sd[t + "feed_forward.w2.weight"]
    compat["norm.weight"] = titan_sd["norm.weight"]
    if not model_args.enable_weight_tying:
        compat["output.weight"] = titan_sd["output.weight"]
    return compat


def _titan_expected_compat(model_args) -> dict:
    """expected_compat_shapes without the sparse layers' router and experts (what TorchTitan's layout covers)."""
    moe = expected_compat_expert_shapes(model_args)
    return {k: v for k, v in expected_compat_shapes(model_args).items() if k not in moe}


def _split_off_experts(sd: dict, names, consume: bool = False) -> tuple[dict, dict]:
    """(the entries of sd named in `names`, the others); `consume`: those entries are taken out of sd."""
    names = set(names)
    moe = {k: sd.pop(k) for k in list(sd) if k in names} if consume else {k: v for k, v in sd.items() if k in names}
    return moe, {k: v for k, v in sd.items() if k not in names}


def _split_to_titan(compat: dict, model_args, own=lambda t: t) -> dict:
    """Compat-layout tensors (all of them or any subset) under TorchTitan names: qkv_proj split
    into wq/wk/wv and gate_up_proj into w1/w3 (views), o_proj -> wo, down_proj -> w2, the rest
    as they are; `own` applied to each resulting tensor."""
    q, kv, inter = _dims(model_args)
    titan = {}
    for name, t in compat.items():
        if name.endswith("attention.qkv_proj.weight"):
            p = name.removesuffix("qkv_proj.weight")
            pieces = zip((p + "wq.weight", p + "wk.weight", p + "wv.weight"), t.split([q, kv, kv], dim=0))
        elif name.endswith("feed_forward.gate_up_proj.weight"):
            p = name.removesuffix("gate_up_proj.weight")
            pieces = zip((p + "w1.weight", p + "w3.weight"), t.split([inter, inter], dim=0))
        else:
            pieces = [(name.replace("attention.o_proj.", "attention.wo.")
                       .replace("feed_forward.down_proj.", "feed_forward.w2."), t)]
        titan.update((k, own(v)) for k, v in pieces)
    return titan


def compat_to_titan(compat_sd: dict, model_args, clone: bool = False) -> dict:
    """Compat layout -> TorchTitan state dict (tied: output.weight is the embedding tensor, as
    `weights.hf_to_titan` gives). Split weights are views of the fused ones unless `clone`. Qwen3-MoE:
    without the sparse layers' router and experts (`expected_titan_shapes`)."""
    check_state_dict(compat_sd, _titan_expected_compat(model_args), "compat state dict", _HINT)
    titan = _split_to_titan(compat_sd, model_args, (lambda t: t.clone()) if clone else (lambda t: t))
    if model_args.enable_weight_tying:
        titan["output.weight"] = titan["tok_embeddings.weight"]
    return titan


def compat_to_hf(compat_sd: dict, model_args, clone: bool = False) -> dict:
    """Compat layout -> HF Qwen3 state dict (split q/k/v and gate/up, experts one tensor each; tied: no
    lm_head.weight), in the canonical order."""
    check_state_dict(compat_sd, expected_compat_shapes(model_args), "compat state dict", _HINT)
    moe, rest = _split_off_experts(compat_sd, expected_compat_expert_shapes(model_args))
    hf = titan_to_hf(compat_to_titan(rest, model_args, clone=clone), model_args)
    hf.update(compat_experts_to_hf({k: v.clone() for k, v in moe.items()} if clone else moe, model_args))
    return {k: hf[k] for k in expected_hf_shapes(model_args)}


def hf_to_compat(hf_sd: dict, model_args, consume: bool = False) -> dict:
    """HF Qwen3 state dict -> compat layout (via TorchTitan; Qwen3-MoE experts directly). `consume`: the experts'
    HF tensors are taken out of hf_sd as they are copied (one host copy at a time)."""
    moe, rest = _split_off_experts(hf_sd, expected_hf_expert_shapes(model_args), consume)
    check_state_dict(moe, expected_hf_expert_shapes(model_args), "HF state dict", _HINT)
    compat = titan_to_compat(hf_to_titan(rest, model_args), model_args)
    compat.update(hf_experts_to_compat(moe, model_args, consume))
    return {k: compat[k] for k in expected_compat_shapes(model_args)}


def compat_to_vllm_weights(compat_sd: dict, model_args) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs for vLLM's `model.load_weights`, which fuses q/k/v and gate/up
    itself (and skips lm_head when embeddings are tied). Tensors are views; vLLM copies them.
    Validation happens here, not on the first `next()`."""
    return iter(compat_to_hf(compat_sd, model_args).items())


def compat_part_to_hf(compat_part: dict, model_args) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of any subset of the compat layout (one layer, say), for vLLM's
    `model.load_weights`, which accepts weights in any number of calls. Names and shapes are
    checked against the model config here, before any pair is produced."""
    expected = expected_compat_shapes(model_args)
    for name, t in compat_part.items():
        if name not in expected:
            raise WeightsError(f"compat weights: unknown name {name!r}; {_HINT}")
        if tuple(t.shape) != expected[name]:
            raise WeightsError(f"compat weights: {name} has shape {list(t.shape)}, expected {list(expected[name])}; "
                               f"{_HINT}")
    moe, rest = _split_off_experts(compat_part, expected_compat_expert_shapes(model_args))
    hf = hf_names_of_titan(_split_to_titan(rest, model_args), model_args)
    hf.update(compat_experts_to_hf(moe, model_args))
    return iter(hf.items())


def read_compat(model_dir: str | Path | ModelDir, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A validated HF checkpoint's weights in the merged layout, on the CPU, cast to `dtype` (None: as stored):
    the one read of a checkpoint's tensors for a model (`load_model`) or a frozen base (LoRA). A ModelDir's
    config is not read again. The HF state dict is dropped as soon as the merged one is built, so the host holds
    one copy at a time besides the cast."""
    checkpoint = read_model_dir(model_dir)
    compat = hf_to_compat(hf_state_dict(checkpoint), checkpoint.args, consume=True)
    return compat if dtype is None else {k: v.to(dtype) for k, v in compat.items()}


def load_model(model_dir: str | Path | ModelDir, device="cpu", dtype=torch.float32,
               backend: str | object = "auto") -> Qwen3VLLMCompatModel:
    """A Qwen3VLLMCompatModel in the merged layout from a validated HF checkpoint directory
    (safetensors only; a ModelDir's config is not read again). `backend`: a kernel-backend name
    (`auto`, `reference`, `vllm`) or object."""
    checkpoint = read_model_dir(model_dir)
    compat_sd = read_compat(checkpoint)
    with torch.device("meta"):
        model = Qwen3VLLMCompatModel(checkpoint.args, backend="reference")
    model.backend = select_backend(backend, device, checkpoint.args) if isinstance(backend, str) else backend
    model.load_state_dict(compat_sd, strict=True, assign=True)
    return model.to(device=device, dtype=dtype)
