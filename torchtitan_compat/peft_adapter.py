"""LoRA adapters on disk in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

What PEFT's `PeftModel.from_pretrained` (on transformers' Qwen3) and vLLM's `LoRARequest` read:
tensors named by the Hugging Face module they adapt,

    base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
    base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
    base_model.model.lm_head.lora_{A,B}.weight

with A [r, in_features] and B [out_features, r], and the config written and parsed by peft's own
`LoraConfig`. Inside the model (torchtitan_compat.lora) the same tensors are the parameters
`layers.{i}.attention.qkv_proj.lora_A.q_proj`, ..., `output.lora_B.lm_head`.

A Qwen3-MoE's experts are adapted as PEFT adapts transformers 5's stacked expert parameters
(`target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]`, torchtitan_compat/lora_experts.py):

    base_model.model.model.layers.{i}.mlp.experts.base_layer.lora_{A,B}.weight   gate_up_proj (both adapted)
    base_model.model.model.layers.{i}.mlp.experts.lora_{A,B}.weight              down_proj (or the only one)

PEFT nests one wrapper per adapted parameter in the module's parameter order, the first innermost, so a
parameter's key has one `base_layer.` per adapted parameter after it. Ours: `layers.{i}.moe.experts.lora_A.gate_up_proj`.

Reading refuses, in one line, what the model cannot compute exactly: DoRA, biases, per-module
ranks or alphas, modules saved whole, layer subsets, adapters whose shapes belong to another base.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from .config import is_moe, sparse_layers
from .lora import (GROUPS, TARGETS, LoRAError, LoRASpec, check_spec, expert_shapes, expert_targets, linear_targets,
                   target_shapes)
from .lora_experts import PARAMS as EXPERT_PARAMS
from .safetensors_io import save_tensors

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_OUR_PATH = {"q_proj": "attention.qkv_proj", "k_proj": "attention.qkv_proj", "v_proj": "attention.qkv_proj",
             "o_proj": "attention.o_proj", "gate_proj": "feed_forward.gate_up_proj",
             "up_proj": "feed_forward.gate_up_proj", "down_proj": "feed_forward.down_proj"}


def hf_module(target: str, layer: int | None) -> str:
    """The Hugging Face Qwen3ForCausalLM module a target names (`model.layers.3.self_attn.q_proj`)."""
    return "lm_head" if target == "lm_head" else f"model.layers.{layer}.{_HF_PARENT[target]}.{target}"


def param_name(target: str, layer: int | None, which: str) -> str:
    """Our model's parameter for adapter `which` ('A' or 'B') of `target` (a module of TARGETS) in `layer`."""
    if target == "lm_head":
        return f"output.lora_{which}.lm_head"
    return f"layers.{layer}.{_OUR_PATH[target]}.lora_{which}.{target}"


def expert_param_name(param: str, layer: int, which: str) -> str:
    """Our model's parameter for adapter `which` of the experts' `param` (EXPERT_PARAMS) in sparse layer `layer`."""
    return f"layers.{layer}.moe.experts.lora_{which}.{param}"


_PARAM = re.compile(r"^(?:layers\.(\d+)\.[a-z_]+\.[a-z_]+|output)\.lora_([AB])\.([a-z_]+)$")


def _expert_key(layer: int, param: str, which: str, experts: tuple[str, ...]) -> str:
    nesting = "base_layer." * (len(experts) - 1 - experts.index(param))
    return f"base_model.model.model.layers.{layer}.mlp.experts.{nesting}lora_{which}.weight"


def peft_key(name: str, experts: tuple[str, ...] = ()) -> str:
    """Our parameter name -> the tensor name in adapter_model.safetensors; `experts`: the expert parameters the
    adapter adapts (EXPERT_PARAMS order), which decide the nesting of an expert parameter's key."""
    m = _PARAM.match(name)
    if not m:
        raise LoRAError(f"{name!r} is not a LoRA parameter of this model")
    layer, which, target = m.groups()
    if target in EXPERT_PARAMS and ".moe.experts." in name:
        return _expert_key(int(layer), target, which, experts or (target,))
    return f"base_model.model.{hf_module(target, None if layer is None else int(layer))}.lora_{which}.weight"


_PEFT_KEY = re.compile(r"^base_model\.model\.(?:model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)|(lm_head))"
                       r"\.lora_([AB])\.weight$")
_PEFT_EXPERT_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)"
                              r"lora_([AB])\.weight$")


def param_of_peft_key(key: str, experts: tuple[str, ...] = ()) -> str | None:
    """The tensor name in adapter_model.safetensors -> our parameter name (None if it is not one); `experts` as
    for `peft_key` (`adapted_experts` reads it from an adapter's config)."""
    m = _PEFT_EXPERT_KEY.match(key)
    if m:
        layer, nesting, which = m.groups()
        depth = nesting.count("base_layer.")
        if depth >= len(experts):
            return None
        return expert_param_name(experts[len(experts) - 1 - depth], int(layer), which)
    m = _PEFT_KEY.match(key)
    if not m:
        return None
    layer, target, head, which = m.groups()
    target = head or target
    if target not in TARGETS:
        return None
    return param_name(target, None if layer is None else int(layer), which)


def _names(entry: str, param: str) -> bool:
    """A `target_parameters` entry names the experts' `param` (PEFT matches the end of `module.param`)."""
    return entry == param or entry.endswith(f".{param}")


def adapted_experts(config: dict) -> tuple[str, ...]:
    """The expert parameters (EXPERT_PARAMS order) an adapter_config.json's `target_parameters` names."""
    named = [str(t) for t in (config.get("target_parameters") or [])]
    return tuple(p for p in EXPERT_PARAMS if any(_names(t, p) for t in named))


def expected_params(spec: LoRASpec, args) -> dict[str, tuple[int, int]]:
    """Our parameter names -> shapes of every adapter tensor of `spec` on a model of `args`."""
    shapes = target_shapes(args)
    experts = expert_targets(spec, args)
    out = {}
    for i in range(args.n_layers):
        for t in linear_targets(spec, args):
            out[param_name(t, i, "A")] = (spec.rank, shapes[t][1])
            out[param_name(t, i, "B")] = (shapes[t][0], spec.rank)
        for t in experts if i in sparse_layers(args) else ():
            (o, n), r = expert_shapes(args)[t], spec.rank * args.moe_args.num_experts
            out[expert_param_name(t, i, "A")] = (r, n)
            out[expert_param_name(t, i, "B")] = (o, r)
    if "lm_head" in spec.targets:
        out[param_name("lm_head", None, "A")] = (spec.rank, shapes["lm_head"][1])
        out[param_name("lm_head", None, "B")] = (shapes["lm_head"][0], spec.rank)
    return out


def write_adapter(out_dir: str | Path, params: dict[str, torch.Tensor], spec: LoRASpec, base_model: str = "",
                  metadata: dict[str, str] | None = None) -> Path:
    """Write `params` (our names -> A/B tensors, saved in float32) as a PEFT adapter in `out_dir`
    (which must exist; callers write into a temporary directory and rename it). The config is
    peft's `LoraConfig(...).save_pretrained`; `metadata` goes into the safetensors header (PEFT
    and vLLM ignore it; spirl records the base model's fingerprint there). Equal adapters are equal
    bytes (a resumed run's checkpoint is the uninterrupted one's, file for file): the header is
    written with sorted keys (torchtitan_compat.safetensors_io), and target_modules is written as
    our ordered list, not as the set LoraConfig makes of it (a set of strings is listed in an order
    that changes from one Python process to the next)."""
    from peft import LoraConfig

    out = Path(out_dir)
    experts = tuple(t for t in EXPERT_PARAMS if any(k.endswith(f".moe.experts.lora_A.{t}") for k in params))
    modules = [t for t in spec.targets if not (experts and t in GROUPS["mlp"])]
    extra = {"target_parameters": [f"mlp.experts.{t}" for t in experts]} if experts else {}
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=modules, lora_dropout=0.0,
                        bias="none", use_rslora=spec.use_rslora, task_type="CAUSAL_LM",
                        base_model_name_or_path=base_model or None, inference_mode=True, **extra)
    config.target_modules = modules
    if experts:
        config.target_parameters = list(extra["target_parameters"])
    config.save_pretrained(str(out))
    save_tensors(out / WEIGHTS_FILE, {peft_key(k, experts): v.detach().float() for k, v in params.items()},
                 {"format": "pt", **(metadata or {})})
    return out


class AdapterError(LoRAError):
    """An adapter directory that cannot be used with this model; one line saying why."""


def _refuse(adapter_dir: Path, what: str) -> AdapterError:
    return AdapterError(f"adapter {adapter_dir}: {what}")


def read_config(adapter_dir: str | Path, args) -> LoRASpec:
    """The LoRASpec of a PEFT adapter directory for a model of `args`, parsed by peft's LoraConfig
    and matched against Qwen3's modules by peft's own target matching; unsupported settings refused."""
    from peft import LoraConfig

    d = Path(adapter_dir)
    if not (d / CONFIG_FILE).is_file():
        raise _refuse(d, f"no {CONFIG_FILE}: pass a PEFT LoRA adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
    try:
        raw = json.loads((d / CONFIG_FILE).read_text())
        cfg = LoraConfig.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - json and peft raise many kinds on a bad file
        raise _refuse(d, f"{CONFIG_FILE} cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:200]})") \
            from None
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(d, f"peft_type {raw.get('peft_type')!r} is not LORA")
    unsupported = [
        (getattr(cfg, "use_dora", False), "DoRA (use_dora)"),
        (cfg.bias != "none", f"bias={cfg.bias!r} (only 'none')"),
        (getattr(cfg, "lora_bias", False), "lora_bias"),
        (bool(cfg.modules_to_save), f"modules_to_save={cfg.modules_to_save}"),
        (bool(cfg.rank_pattern), "per-module ranks (rank_pattern)"),
        (bool(cfg.alpha_pattern), "per-module alphas (alpha_pattern)"),
        (cfg.layers_to_transform is not None, "a layer subset (layers_to_transform)"),
        (cfg.fan_in_fan_out, "fan_in_fan_out"),
        (bool(getattr(cfg, "trainable_token_indices", None)), "trainable_token_indices"),
    ]
    bad = [what for flag, what in unsupported if flag]
    if bad:
        raise _refuse(d, f"uses {', '.join(bad)}, which SPIRL's LoRA does not compute; use a plain LoRA adapter")
    if cfg.lora_dropout:
        log.warning("adapter %s: lora_dropout %g is not applied (SPIRL trains LoRA without dropout: dropout would "
                    "make the trained forward differ from the sampler's)", d, cfg.lora_dropout)
    targets = _module_targets(d, cfg, args) + _parameter_targets(d, raw, args)
    if not targets:
        raise _refuse(d, f"target_modules={cfg.target_modules!r} matches no linear layer of Qwen3 "
                         f"({', '.join(TARGETS)})")
    targets = tuple(t for t in TARGETS if t in targets)
    spec = LoRASpec(rank=int(cfg.r), alpha=float(cfg.lora_alpha), targets=targets, use_rslora=bool(cfg.use_rslora))
    try:
        check_spec(spec, args)
    except LoRAError as e:
        raise _refuse(d, str(e)) from None
    return spec


def _module_targets(d: Path, cfg, args) -> tuple[str, ...]:
    """The TARGETS a LoraConfig's target_modules names (peft's own matching), in every layer or refused."""
    from peft.tuners.tuners_utils import check_target_module_exists

    if not cfg.target_modules:
        return ()
    if cfg.target_modules == "all-linear":
        if is_moe(args):
            raise _refuse(d, "target_modules='all-linear' on a Qwen3-MoE (PEFT adapts the router there too, which "
                             "SPIRL keeps frozen under LoRA); name the modules and target_parameters")
        return GROUPS["all-linear"]
    targets = tuple(t for t in TARGETS
                    if any(check_target_module_exists(cfg, hf_module(t, i)) for i in
                           ([None] if t == "lm_head" else range(args.n_layers))))
    partial = [t for t in targets if t != "lm_head" and not all(
        check_target_module_exists(cfg, hf_module(t, i)) for i in range(args.n_layers))]
    if partial:
        raise _refuse(d, f"adapts {', '.join(partial)} in only some layers; SPIRL adapts a module in every layer")
    mlp = [t for t in targets if t in GROUPS["mlp"]]
    if mlp and is_moe(args):
        raise _refuse(d, f"names the experts' {', '.join(mlp)} in target_modules (transformers 4's per-expert "
                         "layout); SPIRL reads PEFT's format for transformers 5's stacked experts, target_parameters "
                         "mlp.experts.gate_up_proj / mlp.experts.down_proj")
    return targets


def _parameter_targets(d: Path, raw: dict, args) -> tuple[str, ...]:
    """The MLP TARGETS of a Qwen3-MoE adapter's target_parameters (gate_up_proj: gate_proj and up_proj)."""
    named = [str(t) for t in (raw.get("target_parameters") or [])]
    if not named:
        return ()
    experts = adapted_experts(raw)
    unknown = [t for t in named if not any(_names(t, p) for p in experts)]
    if unknown or not is_moe(args):
        raise _refuse(d, f"target_parameters {unknown or named} are not a Qwen3-MoE's expert parameters "
                         "(mlp.experts.gate_up_proj, mlp.experts.down_proj), which are all SPIRL adapts that way")
    return (("gate_proj", "up_proj") if "gate_up_proj" in experts else ()) + \
        (("down_proj",) if "down_proj" in experts else ())


def read_adapter(adapter_dir: str | Path, args) -> tuple[LoRASpec, dict[str, torch.Tensor], dict[str, str]]:
    """(spec, our parameter name -> float32 tensor, safetensors metadata) of a PEFT adapter for a
    model of `args`. Every tensor must be an A or B of a targeted module, with this model's shapes."""
    from safetensors import SafetensorError, safe_open

    d = Path(adapter_dir)
    spec = read_config(d, args)
    path = d / WEIGHTS_FILE
    if not path.is_file():
        other = "adapter_model.bin is there, but only safetensors are read" if (d / "adapter_model.bin").is_file() \
            else "it is missing"
        raise _refuse(d, f"{WEIGHTS_FILE}: {other}")
    try:
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise _refuse(d, f"{WEIGHTS_FILE} is not readable ({' '.join(str(e).split())})") from None
    expected = expected_params(spec, args)
    experts = expert_targets(spec, args)
    by_key = {peft_key(name, experts): name for name in expected}
    unknown = sorted(k for k in tensors if k not in by_key)
    if unknown:
        raise _refuse(d, f"{len(unknown)} tensor(s) are not LoRA A/B weights of its target modules "
                         f"({', '.join(spec.targets)}) on this model, e.g. {unknown[0]}; was it made for another "
                         "base model?")
    missing = sorted(k for k in by_key if k not in tensors)
    if missing:
        raise _refuse(d, f"{len(missing)} LoRA tensor(s) of its target modules are missing, e.g. {missing[0]}")
    params = {}
    for key, name in by_key.items():
        t = tensors[key]
        if tuple(t.shape) != expected[name]:
            raise _refuse(d, f"{key} has shape {list(t.shape)} but this base model needs {list(expected[name])} "
                             f"(rank {spec.rank}): the adapter was made for another base model")
        if not t.is_floating_point():
            raise _refuse(d, f"{key} has dtype {t.dtype}, not a floating-point tensor")
        params[name] = t.float()
    return spec, params, metadata
