"""The trainer's model against torchtitan's plain bf16 Qwen3Model: time, tokens/s, MFU, memory.

    python compare/bench_trainer.py [--model DIR | --shape Qwen3-1.7B [--layers N]]
        [--shapes 8x1024,2x8192,mixed64] [--iters 5] [--warmup 2] [--json OUT] [--device cuda]
        [--activation-checkpointing 0|1] [--tt-attn auto|sdpa|varlen|flex] [--peak-tflops F]
        [--lora-rank R [--lora-targets T]] [--moe-layer-tokens N]
    GPU host:  VLLM_BATCH_INVARIANT=1 python compare/bench_trainer.py
               VLLM_BATCH_INVARIANT=1 python compare/bench_trainer.py --shape Qwen3-30B-A3B --layers 2
    CPU smoke: python compare/bench_trainer.py --device cpu --shape tiny --shapes 2x64,mixed4 --dtype float32
               python compare/bench_trainer.py --device cpu --shape tiny-moe --shapes 2x64 --dtype float32

In one process, on one checkpoint (--model, or random weights of --shape) and the same token ids,
both models compute what the GRPO loss is built on: the log-probability of every next token (rows
0..L-2 of each sequence predict tokens 1..L-1), summed; fwd+bwd backpropagates that sum into the
bf16 parameters. Shapes: BxS (B sequences of S tokens) or mixedN (N sequences, lengths uniform in
32..2048: torch.randint(32, 2049, (N,)) from torch.Generator seed 0).
  ours        the trainer's own path, spirl.numerics.parity.sampled_logprobs, on weights_vllm_compat's
              Qwen3VLLMCompatModel (backend auto: vLLM's batch-invariant kernels on CUDA, reference
              ops on CPU), one packed varlen batch. The host-side packing that path does on every
              call is inside the timing (also shown alone as "ours host prep").
  torchtitan  torchtitan.models.qwen3.Qwen3Model, same args and weights (weights.hf_to_titan, i.e.
              torchtitan's Qwen3StateDictAdapter), bf16 parameters, its own attention (--tt-attn):
                sdpa    [B, S] batch, causal; a mixed batch is right-padded to its longest sequence
                        (the decoder computes the padding; it never counts as tokens or FLOPs)
                varlen  [1, T] packed, block_causal (torch varlen_attn, FlashAttention), no padding
                flex    [1, T] packed, block_causal BlockMask (compiled flex_attention; no CPU backward)
              auto: sdpa for equal lengths; for mixed lengths varlen on CUDA (padded sdpa if varlen
              fails), padded sdpa on CPU. Masks come from torchtitan's get_attention_masks (an
              end-of-document marker closes each sequence; flex: its mask mods, built on the
              batch's device); positions restart per sequence.
              Head: with `model.output = None` torchtitan's forward returns the final hidden states;
              lm_head runs on the predicting rows only (as ours) and the logprob is torchtitan's loss
              math (float32 logits, cross-entropy) in row chunks of ours' size
              (bib.LOGITS_CHUNK_ELEMENTS // vocab), each recomputed in the backward
              (torch.utils.checkpoint): like ours it never holds a [T, vocab] float32 tensor (10 GB
              at 2x8192). --tt-logits-chunk 0: one unchunked block.
Qwen3-MoE (a qwen3_moe --model, --shape tiny-moe or Qwen3-30B-A3B): torchtitan's Qwen3Model with moe_enabled
(its MoE: TokenChoiceTopKRouter with softmax scores and route_norm = norm_topk_prob, GroupedExperts through
torch._grouped_mm on CUDA, its for-loop on the CPU, where torchtitan's grouped path needs a Triton kernel), and
torchtitan's dense block in the layers the checkpoint keeps dense (mlp_only_layers). Weights: weights.hf_to_titan
for everything but the sparse layers' router and experts, which torchtitan's own Qwen3StateDictAdapter maps
(mlp.gate.weight -> moe.router.gate.weight; mlp.experts.{e}.gate_proj / up_proj / down_proj stacked over e ->
moe.experts.w1 / w3 / w2, [E, I, D] / [E, I, D] / [E, D, I]). On the CPU, torchtitan 0.2.2's router counts tokens
per expert with torch.histc of the int64 expert ids, which the CPU does not implement: there the bench counts
them as float32 (the same counts). Sparse layer alone (--moe-layer-tokens N, default 4096, 0 = off): our first
sparse layer's block (router GEMM, top-k, experts) on N random tokens, forward and fwd+bwd (backward = their
difference), with the experts' backward as grouped GEMMs and again as the per-expert loop
(torchtitan_compat.moe.GROUPED_BACKWARD) where the grouped one runs; torchtitan's MoE module on the same weights
and tokens next to it.
Activation checkpointing (default 1, the trainer's default): ours through the model's switch;
torchtitan's per-layer full AC (apply_ac, mode "full") only when ours has the switch, so both
recompute the same; if ours lacks it, both run without and the output says so.

Timing: --warmup runs, then the median of --iters runs, each between synchronize() calls
(perf_counter); fwd+bwd sets grads to None after each run; forward runs under no_grad. Peak memory:
max_memory_allocated over the timed runs. Only one model is on the device at a time (ours for all
shapes, then torchtitan), so it is that side's weights + grads + activations.
MFU = model FLOPs / time / peak dense bf16 FLOP/s (H100 SXM, H200: 989 TFLOP/s; --peak-tflops):
  forward  F = 2 * N_mm * T + A          fwd+bwd = 3 * F          (T = real tokens)
  N_mm = n_layers * (D*(Hq + 2*Hkv)*Dh + Hq*Dh*D + 3*D*I) + V*D  (matmul weights incl. lm_head)
         Qwen3-MoE: the active weights; a sparse layer's 3*D*I is D*E + k*3*D*I_moe (router, k experts)
  A    = n_layers * sum over sequences of 2 matmuls * 2 FLOPs * L^2/2 * Hq * Dh  (causal attention)
Recomputation (activation checkpointing, the chunked head) and padding are not model FLOPs.
--lora-rank R adds "+LoRA" rows: ours again with the base frozen and LoRA adapters (alpha 32) on
--lora-targets, fwd+bwd giving the adapters' gradients only (torchtitan_compat.lora), timed next to
ours with full fine-tuning.
Check, per shape: the per-token logprobs agree, |sum_ours - sum_tt| <= 1e-2 |sum_tt| and
rms(ours - tt) <= 0.25 std(tt) (measured: 1e-4 and 0.04 for all 28 layers of Qwen3-1.7B in bf16;
a wrong position, mask or weight is off by about the logprobs' own spread). Exit 1 if not.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SUM_REL_TOL, TOKEN_RMS_TOL = 1e-2, 0.25
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0))
PASSES = ("forward", "fwd_bwd")


def batch_lengths(name: str) -> list[int]:
    if name.startswith("mixed") and name[5:].isdigit() and int(name[5:]) > 0:
        return torch.randint(32, 2049, (int(name[5:]),), generator=torch.Generator().manual_seed(0)).tolist()
    b, _, s = name.partition("x")
    if not (b.isdigit() and s.isdigit() and int(b) > 0 and int(s) > 1):
        raise ValueError(f"shape {name!r}: use BxS (e.g. 8x1024, S >= 2) or mixedN (e.g. mixed64)")
    return [int(s)] * int(b)


def active_matmul_params(a) -> int:
    """N_mm of the module docstring: the matmul weights a token goes through (a sparse layer: router and k experts)."""
    from torchtitan_compat.config import sparse_layers

    attention = a.dim * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim + a.n_heads * a.head_dim * a.dim
    sparse = set(sparse_layers(a))
    mlp = [a.dim * a.moe_args.num_experts + a.moe_args.top_k * 3 * a.dim * a.moe_inter_dim if i in sparse
           else 3 * a.dim * a.hidden_dim for i in range(a.n_layers)]
    return a.n_layers * attention + sum(mlp) + a.vocab_size * a.dim


def model_flops(a, lengths: list[int]) -> float:
    """Forward FLOPs of the batch (module docstring); fwd+bwd is 3x."""
    n_mm = active_matmul_params(a)
    attention = a.n_layers * sum(2 * 2 * n * n / 2 * a.n_heads * a.head_dim for n in lengths)
    return 2 * n_mm * sum(lengths) + attention


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(run, model, backward: bool, opts, device) -> dict:
    """Median seconds and peak GiB of `run` (-> per-token logprobs): forward, or fwd+bwd of the sum."""
    def once():
        if backward:
            run().sum().backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                run()
    for _ in range(opts.warmup):
        once()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(opts.iters):
        t0 = time.perf_counter()
        once()
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"s": statistics.median(times), "peak_gib": peak}


def guarded(fn, device, model=None) -> dict:
    """fn(), or {"error": "OOM" | message}: one side failing on one shape does not stop the bench."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        out = {"error": "OOM"}
    except Exception as e:  # noqa: BLE001 - reported in the table; the bench goes on
        out = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"}
    if model is not None:
        model.zero_grad(set_to_none=True)
    free(device)
    return out


def check_and_time(run, model, opts, device, tag: str) -> dict:
    res = {"check": guarded(lambda: {"logprobs": torch.no_grad()(run)().double().cpu()}, device, model)}
    for p in PASSES:
        res[p] = guarded(lambda: measure(run, model, p == "fwd_bwd", opts, device), device, model)
        print(f"  {tag} {p}: " + (res[p].get("error") or "{:.4f} s".format(res[p]["s"])), flush=True)
    return res


def set_ours_ac(model, on: bool) -> str:
    if hasattr(model, "set_activation_checkpointing"):
        model.set_activation_checkpointing(on)
    elif hasattr(model, "activation_checkpointing"):
        model.activation_checkpointing = on
    else:
        return "unsupported"
    return "on" if on else "off"


def run_ours(model_dir, seqs_by_shape, opts, device, dtype) -> tuple[dict, str, str, dict | None]:
    from spirl.numerics.samples import Sample
    from spirl.numerics.parity import pack_sampled, sampled_logprobs
    from torchtitan_compat.config import is_moe
    from weights_vllm_compat import load_model

    model = load_model(model_dir, device=device, dtype=dtype, backend="auto").requires_grad_(True)
    ac, results = set_ours_ac(model, bool(opts.activation_checkpointing)), {}
    runs = {}
    for name, seqs in seqs_by_shape.items():
        samples = [Sample(s[:1], s[1:], torch.empty(0)) for s in seqs]  # loss_mask: tokens 1..L-1
        t0 = time.perf_counter()
        pack_sampled(samples, device)
        sync(device)
        prep = time.perf_counter() - t0
        runs[name] = lambda samples=samples: torch.cat(sampled_logprobs(model, samples, device))
        results[name] = {**check_and_time(runs[name], model, opts, device, f"ours {name}"), "host_prep_s": prep}
    layer = time_our_sparse_layer(model, opts, device, dtype) if is_moe(model.args) and opts.moe_layer_tokens else None
    if opts.lora_rank:  # the same model, base frozen, adapters on: what a LoRA run's trainer computes
        from torchtitan_compat.lora import DEFAULT_ALPHA, LoRASpec, apply_lora, parse_targets

        model.requires_grad_(False)
        spec = LoRASpec(opts.lora_rank, DEFAULT_ALPHA, parse_targets(opts.lora_targets))
        apply_lora(model, spec, {k: v.detach() for k, v in model.state_dict().items()}, seed=0)
        for name in seqs_by_shape:
            results[name]["lora"] = check_and_time(runs[name], model, opts, device, f"ours+LoRA {name}")
    return results, ac, model.backend.name, layer


class Grads:
    """What `measure` clears after each fwd+bwd of a layer timed alone: its parameters' and its input's gradients."""

    def __init__(self, *tensors):
        self.tensors = tensors

    def zero_grad(self, set_to_none: bool = True) -> None:
        for t in self.tensors:
            t.grad = None


def layer_input(a, n: int, device, dtype) -> torch.Tensor:
    """n random tokens' activations [n, D] ~ N(0, 1) (a normed hidden state's scale), the same on both sides."""
    return torch.randn(n, a.dim, generator=torch.Generator().manual_seed(2)).to(device, dtype).requires_grad_()


def time_layer(tag: str, run, grads, opts, device, passes=PASSES) -> dict:
    out = {p: guarded(lambda p=p: measure(run, grads, p == "fwd_bwd", opts, device), device, grads) for p in passes}
    print(f"  {tag}: " + ", ".join(f"{p} " + (r.get("error") or "{:.2f} ms".format(1e3 * r["s"]))
                                   for p, r in out.items()), flush=True)
    return out


def time_our_sparse_layer(model, opts, device, dtype) -> dict:
    """Our first sparse layer's block alone (module docstring): forward, fwd+bwd; where the experts' backward runs as
    grouped GEMMs, fwd+bwd again with the per-expert loop."""
    from torchtitan_compat import moe
    from torchtitan_compat.config import sparse_layers

    i = sparse_layers(model.args)[0]
    block, x = model.layers[i].moe, layer_input(model.args, opts.moe_layer_tokens, device, dtype)
    p = SimpleNamespace(backend=model.backend, routes=None, router_logits=None)
    grads = Grads(x, *block.parameters())
    grouped = moe.grouped_backward_runs(x, block.experts.gate_up_proj, block.experts.down_proj)
    out = {"layer": i, "tokens": opts.moe_layer_tokens, "experts_backward": "grouped GEMMs" if grouped else "loop",
           **time_layer(f"ours sparse layer {i} alone", lambda: block(x, p), grads, opts, device)}
    if grouped:
        moe.GROUPED_BACKWARD = False
        try:
            out["loop"] = time_layer("  the same, experts' backward as the loop", lambda: block(x, p), grads, opts,
                                     device, passes=("fwd_bwd",))
        finally:
            moe.GROUPED_BACKWARD = True
    return out


def tt_moe_args(a, device):
    """torchtitan's MoE args for the bench: its grouped GEMMs on CUDA, its for-loop on the CPU (module docstring)."""
    return dataclasses.replace(a.moe_args, use_grouped_mm=device.type == "cuda")


def time_tt_sparse_layer(a, titan_sd, opts, device, dtype) -> dict:
    """torchtitan's MoE module alone on our sparse layer's weights and tokens: forward, fwd+bwd."""
    from torchtitan.models.moe import MoE

    from torchtitan_compat.config import sparse_layers

    i = sparse_layers(a)[0]
    prefix = f"layers.{i}.moe."
    if device.type == "cpu":
        count_ids_as_float_on_cpu()
    with torch.device("meta"):
        block = MoE(tt_moe_args(a, device), dim=a.dim, hidden_dim=a.moe_inter_dim)
    block.to(dtype).to_empty(device=device)
    block.load_state_dict({k[len(prefix):]: v for k, v in titan_sd.items() if k.startswith(prefix)}, strict=True)
    block.tokens_per_expert.zero_()
    x = layer_input(a, opts.moe_layer_tokens, device, dtype)
    return time_layer(f"torchtitan sparse layer {i} alone", lambda: block(x[None]), Grads(x, *block.parameters()),
                      opts, device)


def use_varlen_gqa(a) -> None:
    """torchtitan 0.2.2 calls varlen_attn without enable_gqa, which torch builds that have the flag
    require when Hq != Hkv: compile the same call with it, in torchtitan's compile mode."""
    from torch.nn.attention.varlen import varlen_attn
    from torchtitan.models.attention import VarlenAttentionWrapper as W

    if a.n_heads == a.n_kv_heads or "enable_gqa" not in inspect.signature(varlen_attn).parameters \
            or getattr(W, "_bench_gqa", False):
        return

    def varlen_attn_gqa(*args, **kwargs):
        return varlen_attn(*args, enable_gqa=True, **kwargs)
    W._compiled_varlen_attn, W._bench_gqa = torch.compile(varlen_attn_gqa, mode="max-autotune-no-cudagraphs"), True


def count_ids_as_float_on_cpu() -> None:
    """torchtitan 0.2.2's MoE counts the tokens of each expert with torch.histc of the int64 expert ids, which the
    CPU does not implement ("histogram_cpu" not implemented for 'Long'): for integer CPU tensors, histc of their
    float32 copy, returned in their dtype (the same counts: the ids are exact in float32). Other calls unchanged."""
    histc = torch.histc
    if getattr(histc, "_bench_int_cpu", False):
        return

    def histc_int_cpu(x, *args, **kwargs):
        if x.device.type == "cpu" and not x.is_floating_point():
            return histc(x.float(), *args, **kwargs).to(x.dtype)
        return histc(x, *args, **kwargs)
    histc_int_cpu._bench_int_cpu = True
    torch.histc = histc_int_cpu


def titan_state_dict(hf_sd: dict, a) -> dict:
    """torchtitan's state dict of an HF checkpoint: weights.hf_to_titan (torchtitan's Qwen3StateDictAdapter, checked);
    Qwen3-MoE: hf_to_titan leaves the sparse layers' router and experts out, and the adapter itself maps them
    (module docstring; on args without weight tying, so that it does not add lm_head to this part)."""
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    from torchtitan_compat.config import sparse_layers
    from weights import hf_to_titan

    sparse = tuple(f"model.layers.{i}.mlp." for i in sparse_layers(a))
    moe_part = {k: v for k, v in hf_sd.items() if sparse and k.startswith(sparse)}
    titan = hf_to_titan({k: v for k, v in hf_sd.items() if k not in moe_part}, a)
    if moe_part:
        adapter = Qwen3StateDictAdapter(dataclasses.replace(a, enable_weight_tying=False), hf_assets_path=None)
        titan.update(adapter.from_hf(moe_part))
    return titan


def build_tt(a, titan_sd, attn: str, ac: bool, device, dtype):
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3.model.model import TransformerBlock

    from torchtitan_compat.config import sparse_layers

    a = dataclasses.replace(a, attn_type=attn, attn_mask_type="causal" if attn == "sdpa" else "block_causal")
    if a.moe_enabled:
        a = dataclasses.replace(a, moe_args=tt_moe_args(a, device))
        if device.type == "cpu":
            count_ids_as_float_on_cpu()
    dense_layers = [i for i in range(a.n_layers) if i not in sparse_layers(a)] if a.moe_enabled else []
    with torch.device("meta"):
        model = Qwen3Model(a)  # moe_enabled: every layer sparse, as torchtitan builds Qwen3-MoE
        for i in dense_layers:  # the layers the checkpoint keeps dense (mlp_only_layers): torchtitan's dense block
            model.layers[str(i)] = TransformerBlock(i, dataclasses.replace(a, moe_enabled=False))
    model.to(dtype).to_empty(device=device)
    for name, buf in model.named_buffers():  # torchtitan's per-expert token counters (not in the state dict)
        if name.endswith("tokens_per_expert"):
            buf.zero_()
    if a.enable_weight_tying:  # to_empty gives the two names separate storage: tie them again
        model.output.weight = model.tok_embeddings.weight
    model.load_state_dict(titan_sd, strict=True)
    model.rope_cache = model._precompute_rope_cache().to(device)  # float32, as torchtitan keeps it
    if ac:
        apply_ac(model, ActivationCheckpoint(mode="full"))
    if attn == "varlen":
        use_varlen_gqa(a)
    model.head, model.output = model.output, None  # forward now returns the final hidden states
    return model


def tt_batch(model, seqs, attn: str, device):
    """(tokens, attention_masks, positions, labels) in torchtitan's layout; label -100 = no next token."""
    if attn == "sdpa":
        tokens = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
        labels = torch.full_like(tokens, -100)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)], labels[i, :len(s) - 1] = torch.tensor(s), torch.tensor(s[1:])
        return tokens.to(device), None, None, labels.to(device)
    tokens = torch.tensor([t for s in seqs for t in s])[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    labels = torch.tensor([t for s in seqs for t in s[1:] + [-100]])[None]
    ends = torch.zeros_like(tokens)
    ends[0, torch.tensor([len(s) for s in seqs]).cumsum(0) - 1] = 1
    ends = ends.to(device)
    masks = flex_block_causal_mask(ends) if attn == "flex" else \
        model.get_attention_masks(ends, SimpleNamespace(eos_id=1))
    return tokens.to(device), masks, positions.to(device), labels.to(device)


def flex_block_causal_mask(ends):
    """torchtitan 0.2.2's block_causal BlockMask (Qwen3Model._get_flex_attention_masks: causal and
    same-document, a 1 in `ends` closing each document), built on the device of `ends`.

    torchtitan calls create_block_mask without a device, and torch's default is the accelerator the
    wheel was built for (torch.accelerator.current_accelerator(), no runtime check): cuda in a CUDA
    wheel even on a machine without a GPU, so there the compiled mask build mixed cuda and cpu
    tensors ("Tensor device mismatch ... cuda:0 and cpu")."""
    from torch.nn.attention.flex_attention import and_masks
    from torchtitan.models.attention import create_attention_mask, get_causal_mask_mod, get_document_mask_mod

    mask_mod = and_masks(get_causal_mask_mod(), get_document_mask_mod(ends, 1))
    return create_attention_mask(mask_mod, ends.shape[0], None, ends.shape[1], ends.shape[1], device=ends.device)


def tt_runner(model, batch, chunk_rows: int):
    tokens, masks, positions, labels = batch
    rows = (labels.flatten() != -100).nonzero().squeeze(1)
    targets = labels.flatten()[rows]

    def head_logprobs(h, y):  # torchtitan's loss math: float32 logits, cross-entropy
        return -F.cross_entropy(model.head(h).float(), y, reduction="none")

    def run():
        h = model(tokens, masks, positions).flatten(0, 1)[rows]
        n = chunk_rows or h.shape[0]
        recompute = torch.is_grad_enabled() and n < h.shape[0]
        return torch.cat([checkpoint(head_logprobs, h[i:i + n], targets[i:i + n], use_reentrant=False)
                          if recompute else head_logprobs(h[i:i + n], targets[i:i + n])
                          for i in range(0, h.shape[0], n)])
    return run


def layout(lengths: list[int], attn: str) -> str:
    if attn != "sdpa":
        return f"{attn} [1, {sum(lengths)}] packed, block_causal, no padding"
    pad = len(lengths) * max(lengths) - sum(lengths)
    return f"sdpa [{len(lengths)}, {max(lengths)}] causal" + (
        f", right-padded: {pad} padding tokens ({100 * pad / (pad + sum(lengths)):.0f}% of the batch)" if pad else "")


def run_tt(a, titan_sd, seqs_by_shape, opts, device, dtype, ac: bool, chunk_rows: int) -> dict:
    results = {}
    for name, seqs in seqs_by_shape.items():
        mixed = len({len(s) for s in seqs}) > 1
        choices = [opts.tt_attn] if opts.tt_attn != "auto" else (
            ["varlen", "sdpa"] if mixed and device.type == "cuda" else ["sdpa"])
        for attn in choices:
            def one():
                model = build_tt(a, titan_sd, attn, ac, device, dtype)
                run = tt_runner(model, tt_batch(model, seqs, attn, device), chunk_rows)
                return {"attn": attn, "layout": layout([len(s) for s in seqs], attn),
                        **check_and_time(run, model, opts, device, f"torchtitan {name}")}
            res = guarded(one, device)
            free(device)
            errors = [r["error"] for r in [res] + [res.get(k, {}) for k in ("check",) + PASSES]
                      if r.get("error") not in (None, "OOM")]
            if not errors or attn == choices[-1]:
                break
            print(f"  torchtitan {attn} failed on {name} ({errors[0]}); falling back to {choices[-1]}", flush=True)
        results[name] = res
    return results


def agreement(ours: dict, tt: dict) -> dict:
    if "error" in ours or "error" in tt:
        return {"pass": False, "error": ours.get("error") or tt.get("error")}
    a, b = ours["logprobs"], tt["logprobs"]
    if a.shape != b.shape:
        return {"pass": False, "error": f"{a.numel()} vs {b.numel()} logprobs"}
    sa, sb, d = float(a.sum()), float(b.sum()), a - b
    rel, rms = abs(sa - sb) / abs(sb), float(d.pow(2).mean().sqrt() / b.std())
    return {"ours_sum": sa, "tt_sum": sb, "rel_sum_diff": rel, "rms_diff_over_std": rms,
            "max_abs_diff": float(d.abs().max()), "pass": rel <= SUM_REL_TOL and rms <= TOKEN_RMS_TOL}


def cell(d: dict, key: str, fmt: str) -> str:
    if d.get(key) is not None:
        return fmt.format(d[key])
    return "OOM" if d.get("error") == "OOM" else "ERR" if "error" in d else "-"


def report(name, lengths, a, ours, tt, peak_tflops) -> dict:
    tokens, fwd = sum(lengths), model_flops(a, lengths)
    c = agreement(ours["check"], tt.get("check", tt))
    out = {"lengths": lengths, "tokens": tokens, "predicted": tokens - len(lengths), "tt_attn": tt.get("attn"),
           "tt_layout": tt.get("layout"), "ours_host_prep_s": ours["host_prep_s"], "check": c,
           "model_flops": {"forward": fwd, "fwd_bwd": 3 * fwd}}
    print(f"\n== {name}: {len(lengths)} sequences, {tokens} tokens (lengths {min(lengths)}..{max(lengths)}); "
          f"torchtitan: {tt.get('layout') or tt.get('error')}; ours host prep {ours['host_prep_s']:.4f} s")
    print("logprob check: " + (f"ERROR {c['error']}" if "error" in c else
          f"sum ours {c['ours_sum']:.6e} tt {c['tt_sum']:.6e} rel diff {c['rel_sum_diff']:.2e} "
          f"(tol {SUM_REL_TOL:g}); rms diff / std {c['rms_diff_over_std']:.3f} (tol {TOKEN_RMS_TOL:g}); "
          f"max |diff| {c['max_abs_diff']:.3f}") + (" PASS" if c["pass"] else " FAIL"))
    print(f"{'pass':8s} {'ours s':>9s} {'tt s':>9s} {'ratio':>6s} {'ours tok/s':>11s} {'tt tok/s':>11s} "
          f"{'ours MFU':>8s} {'tt MFU':>8s} {'ours GiB':>8s} {'tt GiB':>8s}")
    for p in PASSES:
        flops, sides = fwd * (3 if p == "fwd_bwd" else 1), {}
        for side, m in (("ours", ours[p]), ("torchtitan", tt.get(p, tt))):
            sides[side] = {"error": m["error"]} if "error" in m else {
                **m, "tok_s": tokens / m["s"], "mfu": flops / m["s"] / (peak_tflops * 1e12) if peak_tflops else None}
        o, t = sides["ours"], sides["torchtitan"]
        ratio = o["s"] / t["s"] if "s" in o and "s" in t else None
        out[p] = {**sides, "ratio": ratio}
        print(f"{p:8s} {cell(o, 's', '{:.4f}'):>9s} {cell(t, 's', '{:.4f}'):>9s} {cell(out[p], 'ratio', '{:.2f}'):>6s} "
              f"{cell(o, 'tok_s', '{:.0f}'):>11s} {cell(t, 'tok_s', '{:.0f}'):>11s} {cell(o, 'mfu', '{:.1%}'):>8s} "
              f"{cell(t, 'mfu', '{:.1%}'):>8s} {cell(o, 'peak_gib', '{:.2f}'):>8s} {cell(t, 'peak_gib', '{:.2f}'):>8s}")
        for side, d in sides.items():
            if d.get("error") not in (None, "OOM"):
                print(f"  {p} {side}: {d['error']}")
        lora = ours.get("lora", {}).get(p)
        if lora is not None:
            out[p]["lora"] = {"error": lora["error"]} if "error" in lora else {
                **lora, "tok_s": tokens / lora["s"], "vs_full": lora["s"] / o["s"] if "s" in o else None,
                "vs_torchtitan": lora["s"] / t["s"] if "s" in t else None}
            d = out[p]["lora"]
            print(f"{'  +LoRA':8s} {cell(d, 's', '{:.4f}'):>9s} {'':>9s} {cell(d, 'vs_torchtitan', '{:.2f}'):>6s} "
                  f"{cell(d, 'tok_s', '{:.0f}'):>11s} {'':>11s} {'':>8s} {'':>8s} {cell(d, 'peak_gib', '{:.2f}'):>8s}"
                  f"   {cell(d, 'vs_full', '{:.2f}')}x ours full fine-tuning")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF Qwen3 checkpoint directory")
    src.add_argument("--shape", default="Qwen3-1.7B", help="random checkpoint of this weights.py shape")
    p.add_argument("--layers", type=int, help="with --shape: number of decoder layers")
    p.add_argument("--shapes", default="8x1024,2x8192,mixed64")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--activation-checkpointing", type=int, default=1, choices=[0, 1])
    p.add_argument("--tt-attn", default="auto", choices=["auto", "sdpa", "varlen", "flex"])
    p.add_argument("--tt-logits-chunk", type=int, help="torchtitan head rows per chunk (0 = one block; "
                   "default: ours' chunk, bib.LOGITS_CHUNK_ELEMENTS // vocab, else 0)")
    p.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s for MFU (default: by GPU name)")
    p.add_argument("--lora-rank", type=int, default=0, help="also time ours with LoRA adapters of this rank on a "
                   "frozen base (the +LoRA rows: time, and its ratio to ours with full fine-tuning); 0 = off")
    p.add_argument("--lora-targets", default="", help="with --lora-rank: modules to adapt (default all-linear)")
    p.add_argument("--moe-layer-tokens", type=int, default=4096, help="Qwen3-MoE: also time our first sparse layer "
                   "alone (and torchtitan's) on this many tokens; 0 = off")
    opts = p.parse_args(argv)
    try:
        opts.lengths = {s: batch_lengths(s) for s in opts.shapes.split(",")}
    except ValueError as e:
        p.error(str(e))
    if opts.iters < 1 or opts.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if opts.lora_rank < 0:
        p.error("--lora-rank must be >= 1 (0 = off)")
    if opts.moe_layer_tokens < 0:
        p.error("--moe-layer-tokens must be >= 1 (0 = off)")
    return opts


def report_sparse_layer(ours: dict, tt: dict | None) -> dict:
    """The sparse layer alone (module docstring): ms of forward, fwd+bwd and backward = their difference, per side;
    the grouped backward's speedup over the loop, ours over torchtitan."""
    def ms(d: dict, p: str):
        return 1e3 * d[p]["s"] if "s" in d.get(p, {}) else None

    sides = {"ours": (ms(ours, "forward"), ms(ours, "fwd_bwd"))}
    if "loop" in ours:
        sides["ours_loop"] = (ms(ours, "forward"), ms(ours["loop"], "fwd_bwd"))
    if tt is not None:
        sides["torchtitan"] = (ms(tt, "forward"), ms(tt, "fwd_bwd"))
    labels = {"ours": f"ours (experts' backward: {ours['experts_backward']})", "ours_loop": "ours, the loop backward",
              "torchtitan": "torchtitan MoE"}
    print(f"\n== sparse layer {ours['layer']} alone, {ours['tokens']} tokens\n"
          f"{'':40s} {'fwd ms':>8s} {'fwd+bwd ms':>10s} {'bwd ms':>8s}")
    out = {"layer": ours["layer"], "tokens": ours["tokens"], "experts_backward": ours["experts_backward"]}
    for side, (f, fb) in sides.items():
        out[side] = {"forward_ms": f, "fwd_bwd_ms": fb, "backward_ms": fb - f if None not in (f, fb) else None}
        print(f"{labels[side]:40s} " + " ".join(cell(out[side], key, "{:.2f}").rjust(w) for key, w in
                                                 (("forward_ms", 8), ("fwd_bwd_ms", 10), ("backward_ms", 8))))
    for key, num, den, ms_of, what in (
            ("backward_speedup", "ours_loop", "ours", "backward_ms", "backward, the loop / grouped GEMMs (speedup)"),
            ("fwd_bwd_ratio_vs_torchtitan", "ours", "torchtitan", "fwd_bwd_ms", "fwd+bwd, ours / torchtitan")):
        a, b = out.get(num, {}).get(ms_of), out.get(den, {}).get(ms_of)
        out[key] = a / b if a and b else None
        if out[key] is not None:
            print(f"{what}: {out[key]:.2f}")
    return out


def moe_meta(a, device) -> dict:
    from torchtitan_compat.config import sparse_layers

    return {"num_experts": a.moe_args.num_experts, "top_k": a.moe_args.top_k, "moe_inter_dim": a.moe_inter_dim,
            "sparse_layers": list(sparse_layers(a)), "active_matmul_params": active_matmul_params(a),
            "torchtitan_experts": "torch._grouped_mm" if tt_moe_args(a, device).use_grouped_mm else "for-loop"}


def main(argv=None) -> int:
    import batch_invariant_backward as bib
    from torchtitan_compat.config import is_moe, model_args_from_hf_config
    from weights import load_hf_checkpoint, write_random_checkpoint

    opts = parse_args(argv)
    device, dtype = torch.device(opts.device), getattr(torch, opts.dtype)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = opts.peak_tflops or next((f for key, f in PEAK_TFLOPS if key in gpu), None)
    with tempfile.TemporaryDirectory() as tmp:  # random weights drawn on the bench's device (fast for MoE shapes)
        model_dir = opts.model or write_random_checkpoint(Path(tmp) / "ckpt", opts.shape, num_layers=opts.layers,
                                                          seed=0, dtype=torch.bfloat16, device=device.type)
        cfg, hf_sd = load_hf_checkpoint(model_dir)
        a = model_args_from_hf_config(cfg)
        gen = torch.Generator().manual_seed(1)
        seqs = {s: [torch.randint(0, a.vocab_size, (n,), generator=gen).tolist() for n in ls]
                for s, ls in opts.lengths.items()}
        moe = moe_meta(a, device) if is_moe(a) else None
        print(f"device {gpu}, peak {peak or '-'} TFLOP/s, torch {torch.__version__}, {opts.dtype}; model "
              f"{opts.model or opts.shape} ({a.n_layers} layers, dim {a.dim}, vocab {a.vocab_size})" + (
                  f"; mixture of experts: {len(moe['sparse_layers'])} sparse layers, {moe['num_experts']} experts of "
                  f"width {moe['moe_inter_dim']}, top-{moe['top_k']}, {moe['active_matmul_params']:,} active "
                  f"matmul weights (MFU's N_mm)" if moe else ""), flush=True)
        ours, ac, backend, our_layer = run_ours(model_dir, seqs, opts, device, dtype)  # loads it as the trainer does
    free(device)
    chunk = opts.tt_logits_chunk if opts.tt_logits_chunk is not None else (  # ours' chunk, if it has one
        max(1, bib.LOGITS_CHUNK_ELEMENTS // a.vocab_size) if hasattr(bib, "LOGITS_CHUNK_ELEMENTS") else 0)
    titan_sd = titan_state_dict(hf_sd, a)
    tt = run_tt(a, titan_sd, seqs, opts, device, dtype, ac == "on", chunk)
    tt_layer = time_tt_sparse_layer(a, titan_sd, opts, device, dtype) if our_layer else None
    vllm_bi = getattr(sys.modules.get("vllm.model_executor.layers.batch_invariant"), "_batch_invariant_MODE", False)
    meta = {"device": gpu, "peak_tflops": peak, "torch": torch.__version__, "dtype": opts.dtype,
            "model": opts.model or opts.shape, "ours_backend": backend, "iters": opts.iters, "warmup": opts.warmup,
            "model_args": {k: getattr(a, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                                                      "hidden_dim", "vocab_size")}, "moe": moe,
            "activation_checkpointing": {"requested": opts.activation_checkpointing, "ours": ac,
                                         "torchtitan": "on (full, per layer)" if ac == "on" else "off"},
            "tt_logits_chunk_rows": chunk, "vllm_aten_overrides_active": vllm_bi,
            "tolerances": {"rel_sum_diff": SUM_REL_TOL, "rms_diff_over_std": TOKEN_RMS_TOL}}
    print(f"\nours: backend {backend}, activation checkpointing {ac}; torchtitan: activation checkpointing "
          f"{meta['activation_checkpointing']['torchtitan']}, head chunk {chunk or 'none'} rows; vLLM aten "
          f"overrides active: {vllm_bi}" + ("\n(the model has no activation-checkpointing switch: both sides run "
                                             "without)" if ac == "unsupported" and opts.activation_checkpointing else ""))
    shapes = {s: report(s, opts.lengths[s], a, ours[s], tt[s], peak) for s in seqs}
    layer = report_sparse_layer(our_layer, tt_layer) if our_layer else None
    ok = all(r["check"]["pass"] for r in shapes.values())
    print(f"\nlogprob agreement (ours vs torchtitan, all shapes): {'PASS' if ok else 'FAIL'}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({**meta, "logprob_agreement": "PASS" if ok else "FAIL",
                                               "shapes": shapes, "sparse_layer": layer}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
