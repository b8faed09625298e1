"""LoRA training: a policy whose trained parameters are LoRA adapters, merged into the engine's own weights.

Design (docs/lora.md): the rollout engine serves merged weights W' = round(W + s B A), so it runs
at full speed and does not know it serves LoRA; the trainer computes with the very same W', so
parity is full fine-tuning's problem. One copy of the weights is on the GPU:

* with vLLM, the engine is built with placeholder weights (`load_format="dummy"`) and given the
  base in memory; the trainer's model then adopts the engine's tensors (vLLM's Qwen3 keeps the
  fused `qkv_proj` / `gate_up_proj` layout the trainer uses; `VLLMEngine.compat_weights`). After
  every optimizer step each adapted block of W' is rewritten in place (`LoRAPolicy.push_masters_to_model`):
  that is the weight sync, and nothing is copied into the engine;
* the frozen base W of the adapted projections stays in pinned host memory (`--lora-base host`,
  streamed in by each merge) or on the GPU (`--lora-base gpu`); embeddings and norms are frozen
  and exist once, in the engine;
* the native engine (CPU) decodes with the trainer's model itself, so the same holds there.

Several ranks (torchrun): data parallel with replicated adapters. Each rank builds exactly what one GPU
builds (its own engine on its GPU, the whole frozen base, the adapters from the same seed), samples and
trains on its own share of the prompts, and `reduce_grads` averages the adapters' gradients over the
ranks (one all-reduce of a flat float32 buffer) before the optimizer step, so every rank takes the same
step and the replicas stay equal bit for bit (checked at every checkpoint, `check_replicas`). Sharding
the adapters would save little: they are ~1-2 % of the weights (docs/distributed.md).

Only the adapters (float32) have gradients and AdamW state. The reference policy (kl_coef > 0) is
the initial adapters: merged in for the reference forward, merged out after. Checkpoints hold the
adapters as a PEFT adapter (spirl.core.checkpoint); `--lora-init` starts from one. What to build
comes in a PolicySpec whose `lora` (spirl.core.spec.LoRAInit) is set; resolve_spec makes that
LoRAInit from simple_rl.py's flags.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchtitan_compat.config import ModelDir
from torchtitan_compat.lora import DEFAULT_ALPHA, LoRAError, LoRALinear, LoRASpec, check_spec, parse_targets
from torchtitan_compat.peft_adapter import AdapterError, read_adapter

from .config import TrainConfig
from .pinned import PinnedPool
from .policy import Policy
from .spec import LoRAInit, PolicySpec

log = logging.getLogger("spirl.core.lora")

FINGERPRINT_KEY = "spirl_base_fingerprint"
"""Safetensors metadata key of the adapters SPIRL writes: the base checkpoint's fingerprint."""


def resolve_spec(cfg: TrainConfig, args, model_dir: Path, fingerprint: str | None = None) -> LoRAInit:
    """The run's LoRA: from --lora-init's adapter (whose rank, alpha and targets win; flags that
    disagree are refused) or from the flags. Refused in one line: a rank the layers cannot have, an
    unknown target, an adapter written for another base (shapes, or SPIRL's recorded fingerprint)."""
    if cfg.lora_init:
        spec, params, meta = read_adapter(cfg.lora_init, args)
        disagree = [f"--{k} {mine}" for k, mine, theirs in (
            ("lora-rank", cfg.lora_rank, spec.rank), ("lora-alpha", cfg.lora_alpha, spec.alpha),
            ("lora-targets", cfg.lora_targets, ",".join(spec.targets))) if mine and (
            parse_targets(mine) != spec.targets if k == "lora-targets" else mine != theirs)]
        if disagree:
            raise LoRAError(f"--lora-init {cfg.lora_init} has rank {spec.rank}, alpha {spec.alpha:g}, targets "
                            f"{','.join(spec.targets)}, which {' and '.join(disagree)} contradict; leave those "
                            "flags unset to use the adapter's")
        theirs = meta.get(FINGERPRINT_KEY)
        if theirs and fingerprint and theirs != fingerprint:
            raise AdapterError(f"adapter {cfg.lora_init} was trained on another base model (fingerprint {theirs}; "
                               f"--model {cfg.model} is {fingerprint}); pass the --model it was trained on")
        return LoRAInit(spec, params)
    spec = LoRASpec(cfg.lora_rank, cfg.lora_alpha or DEFAULT_ALPHA, parse_targets(cfg.lora_targets))
    check_spec(spec, args)
    return LoRAInit(spec)


@dataclass
class LoRAPolicy(Policy):
    """A Policy whose masters are the LoRA adapters (float32, on the device, trained directly: no
    separate compute copy) and whose model computes with merged weights (see the module docstring)."""

    spec: LoRASpec | None = None
    modules: dict[str, LoRALinear] = field(default_factory=dict)
    reference_adapters: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None
    """Module path -> {target: (A, B)} of the initial adapters, kept when there is a KL term."""
    engine_shares_weights = True
    shards_model = False
    merge_phase = "lora_merge"

    def reduce_grads(self) -> None:
        """Several ranks: the mean over ranks of each adapter gradient. Each rank's loss is its share of the
        mini-batch's loss times the rank count (normalizers over every rank: spirl/loops/loss.py), so the
        mean of the ranks' gradients is the gradient of the mini-batch's loss. One all-reduce (sum) of
        every gradient flattened into one float32 buffer, in parameter order, then a division by the rank
        count; every rank receives the same sum, so every replica takes the same optimizer step."""
        world = self.world
        if not world.sharded:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        params = list(self.masters.values())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = _flatten_dense_tensors(grads)
        world.all_reduce_sum_(flat)
        flat.div_(world.size)
        for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
            p.grad = g

    @torch.no_grad()
    def push_masters_to_model(self) -> None:
        """W' = round(W + s B A) for every adapted block: the forward's and the engine's weights."""
        for m in self.modules.values():
            m.merge()

    def grads_to_masters(self) -> None:
        """The adapters are the masters: autograd accumulated their float32 grads already."""

    @property
    def has_reference(self) -> bool:
        return self.reference_adapters is not None

    @contextmanager
    def reference_model(self):
        """The model with the initial adapters merged in; the current ones are merged back after."""
        try:
            for path, m in self.modules.items():
                m.merge(self.reference_adapters[path])
            yield self.model
        finally:
            self.push_masters_to_model()


def _adapted_keys(spec: LoRASpec, args) -> list[str]:
    """Compat names of the weights that get adapters (whose frozen base must be kept); a Qwen3-MoE's experts
    (`layers.{i}.moe.experts.gate_up_proj`, ...) when the MLP is targeted."""
    from torchtitan_compat.config import sparse_layers
    from torchtitan_compat.lora import expert_targets, fused_modules, linear_targets

    linear = linear_targets(spec, args)
    paths = [p for p, blocks in fused_modules(args).items() if any(t in linear for t, _, _ in blocks)]
    keys = [f"layers.{i}.{p}.weight" for i in range(args.n_layers) for p in paths]
    keys += [f"layers.{i}.moe.experts.{t}" for i in sparse_layers(args) for t in expert_targets(spec, args)]
    return keys + (["output.weight"] if "lm_head" in spec.targets else [])


def build_lora_policy_and_engine(model: ModelDir, spec: PolicySpec, device: torch.device, world):
    """(LoRAPolicy, engine) of `spec` (its `lora` set) sharing one copy of the weights (see the module
    docstring)."""
    from torchtitan_compat.lora import apply_lora, lora_modules

    from .distributed import one_local_rank_at_a_time
    from .optim import build_adamw
    from .policy import build_engine

    dtype = getattr(torch, spec.dtype)
    lora, args = spec.lora.spec, model.args
    untie = "lm_head" in lora.targets and args.enable_weight_tying
    if untie:
        log.info("LoRA on lm_head with tied embeddings: the output projection gets its own weight (base = the "
                 "embedding); the input embedding stays frozen")
    engine = None
    if spec.engine.kind == "vllm":  # vLLM's set-up is collective under torchrun: every rank builds its engine at once
        engine = build_engine(spec.engine, model, None, world, load_format="dummy", untie_lm_head=untie)
    # the ranks of one host in turn: one transient peak at a time on top of the others' pinned bases
    weights, base = one_local_rank_at_a_time(world, lambda: _load_weights(model, spec, device, engine, untie))
    head = weights.pop("output.weight", None) if untie else None  # tied: the model itself has no output weight
    compute = _frozen_model(args, weights, spec, device)
    apply_lora(compute, lora, base, seed=spec.seed, head_weight=head)
    masters = {n: p for n, p in compute.named_parameters() if p.requires_grad}
    if spec.lora.params is not None:
        with torch.no_grad():
            for n, p in masters.items():
                p.copy_(spec.lora.params[n])
    modules = lora_modules(compute)
    reference = None
    if spec.reference:
        reference = {path: {t: (m.lora_A[t].detach().clone(), m.lora_B[t].detach().clone()) for t, _, _ in m.blocks}
                     for path, m in modules.items()}
    policy = LoRAPolicy(masters, compute, None, build_adamw(masters, spec.lr, spec.weight_decay), world, dtype,
                        spec=lora, modules=modules, reference_adapters=reference)
    policy.push_masters_to_model()
    n = sum(p.numel() for p in masters.values())
    log.info("LoRA rank %d, alpha %g (scale %.4g) on %s: %s trainable parameters; frozen base in %s memory",
             lora.rank, lora.alpha, lora.scale, ",".join(lora.targets), f"{n:,}",
             "GPU" if device.type == "cuda" and spec.lora_base == "gpu" else "host")
    if engine is None:
        engine = build_engine(spec.engine, model, policy)
    return policy, engine


def _load_weights(model: ModelDir, spec: PolicySpec, device: torch.device, engine, untie: bool) -> tuple[dict, dict]:
    """(the model's weights, the frozen base of the adapted ones), from the checkpoint read once: the weights are
    the vLLM engine's own tensors (loaded into it here), or copies on `device` for the native engine. The host
    memory peaks at about twice the bf16 model while the fused layout is built."""
    import weights_vllm_compat

    args = model.args
    compat = weights_vllm_compat.read_compat(model, getattr(torch, spec.dtype))
    if engine is not None:
        named = dict(weights_vllm_compat.compat_to_vllm_weights(compat, args))
        if untie:
            named["lm_head.weight"] = compat["tok_embeddings.weight"]
        engine.load_all_weights(named.items())
        del named
        weights = engine.compat_weights(args)
    else:
        weights = {k: v.to(device, copy=True) for k, v in compat.items()}
        if untie:
            weights["output.weight"] = compat["tok_embeddings.weight"].to(device, copy=True)
    base = {}  # the frozen base of every adapted weight; the rest lives only in the model (the engine)
    pool = PinnedPool() if device.type == "cuda" and spec.lora_base != "gpu" else None
    for k in _adapted_keys(spec.lora.spec, args):
        src = "tok_embeddings.weight" if k == "output.weight" and untie else k
        w = compat[src]
        if device.type == "cuda":
            w = w.to(device, copy=True) if pool is None else pool.copy(w)
        base[k] = w
        if src != "tok_embeddings.weight":
            del compat[src]  # one host copy at a time
    if pool is not None:
        log.info("frozen base pinned in host memory: %.1f GiB", pool.reserved / 2**30)
    return weights, base


def _frozen_model(args, weights: dict, spec: PolicySpec, device: torch.device):
    """The compute model on `weights` (assigned, not copied), frozen, with the kernels of `device`."""
    from torchtitan_compat import Qwen3VLLMCompatModel, select_backend

    with torch.device("meta"):
        compute = Qwen3VLLMCompatModel(args, backend="reference")
    compute.backend = select_backend(spec.backend, device, args)
    compute.load_state_dict(weights, strict=True, assign=True)
    compute.requires_grad_(False)
    compute.activation_checkpointing = spec.activation_checkpointing
    return compute


def adapter_writer(policy: LoRAPolicy, spec: PolicySpec, fingerprint: str):
    """A function writing the policy's adapters as a PEFT adapter into a directory (for checkpoints);
    the adapter records `spec.model` as its base model."""
    from torchtitan_compat.peft_adapter import write_adapter

    def write(directory: Path) -> None:
        write_adapter(directory, policy.masters, policy.spec, base_model=spec.model,
                      metadata={FINGERPRINT_KEY: fingerprint})
    return write
