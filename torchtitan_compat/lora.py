"""LoRA on the vLLM-compatible Qwen3: low-rank adapters merged into the weights the model computes with.

Each adapted projection keeps three things:
    weight  W' = round(W + s B A)   what the forward multiplies by (frozen; spirl.core.lora makes it the
                                    rollout engine's own tensor, so both compute with one W')
    base    W                       the frozen base, rows of this projection (host or GPU memory)
    adapters A [r, in], B [out, r]  float32 parameters, trained; s = alpha / r (alpha / sqrt(r) rsLoRA)
`merge()` recomputes W' after every optimizer step. The forward is then exactly a plain linear on
W' (the engine's product, bit for bit), and the backward gives dA, dB from low-rank products
(batch_invariant_backward.LoRALinearFunction); design and measurements: docs/lora.md.

Modules are named as PEFT names them on Hugging Face's Qwen3 (`q_proj`, `k_proj`, `v_proj`,
`o_proj`, `gate_proj`, `up_proj`, `down_proj`, `lm_head`); q/k/v are row blocks of our fused
`qkv_proj` and gate/up of `gate_up_proj`, each with its own A and B, as PEFT and vLLM keep them.
With tied embeddings an adapted lm_head gets its own W' (the input embedding stays the base's):
the output projection is untied from the embedding, exactly what PEFT computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

import batch_invariant_backward as bib

from .config import is_moe, sparse_layers
from .lora_experts import PARAMS as EXPERT_PARAMS
from .lora_experts import LoRAExperts

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
"""Every module LoRA can adapt, in model order."""
GROUPS = {
    "attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "all-linear": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
"""Names for sets of targets. `all-linear` is PEFT's: every linear layer except the output layer."""
DEFAULT_TARGETS = "all-linear"
DEFAULT_ALPHA = 32.0
"""alpha when none is given: Thinking Machines' choice for LoRA RL ("LoRA Without Regret"), with
which the best learning rate barely depends on the rank (s = alpha / r and B starts at zero)."""


class LoRAError(ValueError):
    """A LoRA setting or adapter this model cannot use; one line saying what to do."""


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    """r: the adapters' inner dimension."""
    alpha: float
    """The update s B A is scaled by s = alpha / rank (alpha / sqrt(rank) with use_rslora)."""
    targets: tuple[str, ...]
    """Adapted modules, a subset of TARGETS in its order."""
    use_rslora: bool = False
    """Rank-stabilized scaling (PEFT's `use_rslora`), only ever read from an adapter."""

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def parse_targets(text: str) -> tuple[str, ...]:
    """'attn,lm_head' -> ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'lm_head'); '' -> all-linear."""
    names: list[str] = []
    for item in (text or DEFAULT_TARGETS).split(","):
        item = item.strip()
        if item in GROUPS:
            names += GROUPS[item]
        elif item in TARGETS:
            names.append(item)
        elif item:
            raise LoRAError(f"unknown LoRA target {item!r}: use a comma-separated list of {', '.join(TARGETS)} or "
                            f"the groups {', '.join(GROUPS)}")
    return tuple(t for t in TARGETS if t in names)


def target_shapes(args) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every module LoRA can adapt, for torchtitan model args."""
    q, kv, d, inter = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.dim, args.hidden_dim
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q), "gate_proj": (inter, d),
            "up_proj": (inter, d), "down_proj": (d, inter), "lm_head": (args.vocab_size, d)}


def fused_modules(args) -> dict[str, list[tuple[str, int, int]]]:
    """Our model's linear modules (path inside a decoder layer, or `output`) -> the PEFT modules
    they hold as row blocks: [(target, first row, rows)]."""
    s = target_shapes(args)
    q, kv, inter = s["q_proj"][0], s["k_proj"][0], s["gate_proj"][0]
    return {
        "attention.qkv_proj": [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
        "attention.o_proj": [("o_proj", 0, s["o_proj"][0])],
        "feed_forward.gate_up_proj": [("gate_proj", 0, inter), ("up_proj", inter, inter)],
        "feed_forward.down_proj": [("down_proj", 0, s["down_proj"][0])],
        "output": [("lm_head", 0, s["lm_head"][0])],
    }


def expert_targets(spec: LoRASpec, args) -> tuple[str, ...]:
    """The experts' parameters (lora_experts.PARAMS) `spec` adapts on a Qwen3-MoE: gate_up_proj for gate_proj and
    up_proj (one parameter in PEFT's format, one adapter), down_proj for down_proj; () on a dense model."""
    if not is_moe(args):
        return ()
    named = {"gate_up_proj": "gate_proj" in spec.targets, "down_proj": "down_proj" in spec.targets}
    return tuple(t for t in EXPERT_PARAMS if named[t])


def linear_targets(spec: LoRASpec, args) -> tuple[str, ...]:
    """The targets each decoder layer adapts as linear modules (LoRALinear): all but lm_head, and on a Qwen3-MoE
    whose experts are adapted, all but the MLP ones (the experts take those: `expert_targets`)."""
    experts = expert_targets(spec, args)
    return tuple(t for t in spec.targets if t != "lm_head" and not (experts and t in GROUPS["mlp"]))


def expert_shapes(args) -> dict[str, tuple[int, int]]:
    """(out, in) of one expert of each adaptable expert parameter of Qwen3-MoE args."""
    d, inter = args.dim, args.moe_inter_dim
    return {"gate_up_proj": (2 * inter, d), "down_proj": (d, inter)}


def _check_moe_mlp(spec: LoRASpec, args) -> None:
    """On a Qwen3-MoE the MLP targets adapt the experts as PEFT does (`target_parameters`), which needs gate and up
    together and every layer sparse."""
    mlp = [t for t in spec.targets if t in GROUPS["mlp"]]
    if not mlp or not is_moe(args):
        return
    dense = [i for i in range(args.n_layers) if i not in sparse_layers(args)]
    if dense:
        raise LoRAError(f"LoRA on the MLP of a Qwen3-MoE with dense layers ({', '.join(map(str, dense))}: "
                        "mlp_only_layers / decoder_sparse_step) is not supported: PEFT maps gate_proj/up_proj to the "
                        "experts on such models; adapt attention and lm_head only (--lora-targets attn,lm_head; "
                        "Tinker API: train_mlp=False)")
    if ("gate_proj" in mlp) != ("up_proj" in mlp):
        raise LoRAError(f"LoRA on a Qwen3-MoE's experts adapts gate and up as one parameter (gate_up_proj, PEFT's "
                        f"format), but only {' and '.join(mlp)} was named: name both gate_proj and up_proj (or mlp)")


def check_spec(spec: LoRASpec, args) -> None:
    """Refuse, in one line, a rank the adapted layers cannot have, or MLP targets a Qwen3-MoE cannot take."""
    if spec.rank < 1:
        raise LoRAError(f"LoRA rank must be >= 1, got {spec.rank}")
    if not spec.targets:
        raise LoRAError("LoRA needs at least one target module")
    _check_moe_mlp(spec, args)
    shapes = target_shapes(args)
    if is_moe(args):
        shapes = {**shapes, "gate_proj": expert_shapes(args)["gate_up_proj"],
                  "up_proj": expert_shapes(args)["gate_up_proj"], "down_proj": expert_shapes(args)["down_proj"]}
    smallest = min(spec.targets, key=lambda t: min(shapes[t]))
    if spec.rank > min(shapes[smallest]):
        out, inp = shapes[smallest]
        raise LoRAError(f"LoRA rank {spec.rank} is larger than {smallest} ({out} x {inp}) allows: a rank above "
                        f"min(out, in) = {min(out, inp)} adds nothing a full update would not; lower the rank")


def lora_param_count(spec: LoRASpec, args) -> int:
    """Trainable parameters of `spec` on a model of `args`."""
    shapes = target_shapes(args)
    per_layer = sum(spec.rank * sum(shapes[t]) for t in linear_targets(spec, args))
    per_layer += sum(spec.rank * args.moe_args.num_experts * sum(expert_shapes(args)[t])
                     for t in expert_targets(spec, args))
    head = spec.rank * sum(shapes["lm_head"]) if "lm_head" in spec.targets else 0
    return args.n_layers * per_layer + head


def merged(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, out_dtype: torch.dtype,
           device=None) -> torch.Tensor:
    """W + s B A rounded once to `out_dtype`, computed as PEFT merges an adapter into a base
    (`get_delta_weight`, then `weight.data += delta`): delta = (B @ A) * s in float32, then
    float32(W) + delta (float64 throughout for float64 tensors). `base` may live in host memory."""
    w = base.to(device if device is not None else a.device, non_blocking=True)
    cdt = torch.float64 if torch.float64 in (w.dtype, a.dtype) else torch.float32
    delta = (b.to(cdt) @ a.to(cdt)) * scale
    return (w.to(cdt) + delta).to(out_dtype)


class LoRALinear(nn.Module):
    """A linear layer computing with the merged weight W' and training LoRA adapters on row blocks of it.

    `weight`: W' itself (adopted, not copied: it may be the rollout engine's tensor); `base`: the
    frozen W, same shape, anywhere (pinned host memory keeps the GPU's copy of the weights single);
    `blocks`: [(target, first row, rows)] of the blocks to adapt. A starts at PEFT's default
    (uniform in +-1/sqrt(in_features), drawn from `generator`), B at zero, so W' starts as W."""

    def __init__(self, weight: torch.Tensor, base: torch.Tensor, blocks: list[tuple[str, int, int]],
                 spec: LoRASpec, generator: torch.Generator | None = None, device=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.blocks = list(blocks)
        self.base = {t: base[o:o + n] for t, o, n in self.blocks}
        """Rows of the frozen base per target: not a parameter or buffer (no state_dict, no .to())."""
        self.scale = spec.scale
        device = weight.device if device is None else device
        fan_in = weight.shape[1]
        bound = 1.0 / math.sqrt(fan_in)
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for t, _, n in self.blocks:
            a = torch.empty(spec.rank, fan_in, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
            self.lora_A[t] = nn.Parameter(a.to(device))
            self.lora_B[t] = nn.Parameter(torch.zeros(n, spec.rank, dtype=torch.float32, device=device))

    def adapters(self) -> list[torch.Tensor]:
        """(A_0, B_0, A_1, B_1, ...) in block order."""
        return [p for t, _, _ in self.blocks for p in (self.lora_A[t], self.lora_B[t])]

    def apply(self, x: torch.Tensor, backend) -> torch.Tensor:
        return bib.lora_linear(x, self.weight, [(o, n) for _, o, n in self.blocks], self.scale, backend,
                               self.adapters())

    def forward(self, x: torch.Tensor, p) -> torch.Tensor:
        return self.apply(x, p.backend)

    def head_lora(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(A, B, scale) of an adapted lm_head (one block), for bib.lm_head_logprobs."""
        (t, _, _), = self.blocks
        return self.lora_A[t], self.lora_B[t], self.scale

    @torch.no_grad()
    def merge(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """W'[block] = round(W[block] + s B A) for every block, from this module's adapters or from
        `adapters` ({target: (A, B)}: another policy's, e.g. the reference's)."""
        for t, o, n in self.blocks:
            a, b = adapters[t] if adapters is not None else (self.lora_A[t], self.lora_B[t])
            self.weight[o:o + n].copy_(merged(self.base[t], a, b, self.scale, self.weight.dtype, self.weight.device))


def apply_lora(model: nn.Module, spec: LoRASpec, base: dict[str, torch.Tensor], seed: int,
               head_weight: torch.Tensor | None = None) -> list[LoRALinear | LoRAExperts]:
    """Replace every targeted linear module of a Qwen3VLLMCompatModel by a LoRALinear adopting
    the module's weight as W', and on a Qwen3-MoE with MLP targets each sparse layer's experts by a
    LoRAExperts (torchtitan_compat/lora_experts.py); returns them in model order (layer by layer, then
    lm_head). `base`: compat name -> frozen W of each such module (full fused matrices; `output.weight`
    for lm_head; `layers.{i}.moe.experts.gate_up_proj` / `.down_proj` for the experts).
    The adapters' initial A are drawn in that order from one CPU generator seeded with `seed`, so
    the same seed gives the same A on any device.
    Tied embeddings with lm_head targeted: `head_weight` is the tensor to hold the head's W'
    (the engine's untied lm_head, or a copy of the embedding); it becomes `model.output`."""
    check_spec(spec, model.args)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = model.tok_embeddings.weight.device
    modules = fused_modules(model.args)
    experts = expert_targets(spec, model.args)
    out: list[LoRALinear | LoRAExperts] = []
    for i, layer in enumerate(model.layers):
        for path, blocks in modules.items():
            blocks = [blk for blk in blocks if blk[0] in spec.targets]
            if path == "output" or not blocks or not hasattr(layer, path.split(".")[0]):
                continue
            parent, name = path.split(".")
            owner = getattr(layer, parent)
            lin = LoRALinear(getattr(owner, name).weight.data, base[f"layers.{i}.{path}.weight"], blocks, spec, gen,
                             device)
            setattr(owner, name, lin)
            out.append(lin)
        if experts and hasattr(layer, "moe"):
            layer.moe.experts = _lora_experts(layer.moe.experts, base, f"layers.{i}.moe.experts", experts, spec, gen,
                                              device)
            out.append(layer.moe.experts)
    if "lm_head" in spec.targets:
        if model.output is None and head_weight is None:
            raise LoRAError("tied embeddings: an adapted lm_head needs its own weight tensor (head_weight)")
        weight = head_weight if model.output is None else model.output.weight.data
        model.output = LoRALinear(weight, base["output.weight"], modules["output"], spec, gen, device)
        out.append(model.output)
    return out


def _lora_experts(experts: nn.Module, base: dict[str, torch.Tensor], prefix: str, targets: tuple[str, ...],
                  spec: LoRASpec, gen: torch.Generator, device) -> LoRAExperts:
    """LoRAExperts adopting a sparse layer's expert tensors as W' (`base`: compat name -> frozen W)."""
    weights = {t: getattr(experts, t).data for t in EXPERT_PARAMS}
    frozen = {t: base[f"{prefix}.{t}"] for t in targets}
    return LoRAExperts(weights, frozen, targets, spec.rank, spec.scale, gen, device)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear | LoRAExperts]:
    """Module path -> LoRALinear / LoRAExperts of a model `apply_lora` was applied to, in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExperts))}
