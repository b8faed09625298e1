"""Qwen3 shapes and the mapping between Hugging Face `config.json` and torchtitan's model args.

torchtitan's `Qwen3ModelArgs` is the one model config of the project; this module only translates
it to and from the Hugging Face `config.json` that checkpoints (and vLLM) read, and validates it.

A config.json is read the way vLLM reads it, so that the trainer computes vLLM's math:
transformers' own `Qwen3Config` parses it (vLLM >= 0.26 parses with transformers >= 5.5 too), so
a field the file leaves out gets the default that both use, and every number comes from the
parsed config. Two kinds of config.json exist: transformers 4.x writes a top-level `rope_theta`
(and `rope_scaling`), 5.x writes `rope_parameters: {rope_type, rope_theta}`; both are accepted.

What the model cannot compute exactly is refused with a one-line `ConfigError`: any RoPE other
than plain RoPE, sliding-window or chunked attention, attention bias, mixture of experts,
quantized weights, an activation other than SiLU, shared experts. So are the fields whose default
differs between transformers and vLLM (`_NO_SHARED_DEFAULT`) when config.json leaves them out.

Qwen3-MoE (`model_type: qwen3_moe`) is read by transformers' `Qwen3MoeConfig` the same way; its
args are `MoEModelArgs`: torchtitan's own MoE fields (`moe_enabled`, `moe_inter_dim`, `moe_args`,
as torchtitan's 30B-A3B entry sets them) plus which layers are sparse (`decoder_sparse_step`,
`mlp_only_layers`, the rule transformers and vLLM share) and `router_aux_loss_coef`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs
from transformers import Qwen3Config, Qwen3MoeConfig

QWEN3_VOCAB_SIZE = 151936
"""Rows of Qwen3's embedding (the tokenizer uses 151669 of them; the rest is padding)."""

# Real Qwen3 config.json values (Qwen/Qwen3-0.6B, -1.7B, -4B, -8B, -14B, -32B: 32.8B parameters, as its model card says) plus a tiny test shape that
# keeps the real vocabulary (so the real tokenizer's ids are valid) and Qwen3's head_dim of 128:
# with head_dim 64, vLLM's FA3 gave a decode row that differs from the same row computed in a
# prefill (measured on an H200), i.e. vLLM would not even agree with itself.
SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, tie_word_embeddings=False,
    ),
    # the learning-curve demo's starting model (compare/learning_curve.py): big enough to learn
    # two-digit addition in a few GPU minutes, small enough that a GRPO step takes well under a second
    "small": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, tie_word_embeddings=False,
    ),
    "Qwen3-0.6B": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "Qwen3-1.7B": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "Qwen3-4B": dict(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    ),
    "Qwen3-8B": dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "Qwen3-14B": dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "Qwen3-32B": dict(
        hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    # Qwen3-MoE. The CPU test shape: 8 experts, top-2, layer 0 dense through mlp_only_layers
    "tiny-moe": dict(
        _moe=True, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
    ),
    # Qwen/Qwen3-30B-A3B's config.json (30.5B parameters, 3.3B active, as its model card says)
    "Qwen3-30B-A3B": dict(
        _moe=True, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
}

_COMMON = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
    attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
    initializer_range=0.02, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_scaling=None,
    rope_theta=1000000, sliding_window=None, use_cache=True, use_sliding_window=False,
    vocab_size=QWEN3_VOCAB_SIZE, torch_dtype="bfloat16",
)

_MOE_COMMON = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", output_router_logits=False,
                   router_aux_loss_coef=0.001, max_window_layers=48)

_SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
"""Required although transformers has defaults for them: those are placeholder sizes (hidden 4096,
32 layers, ...) that a checkpoint omitting them is very unlikely to have been trained with."""

_NO_SHARED_DEFAULT = {
    "head_dim": "transformers' Qwen3Config defaults it to 128, vLLM's Qwen3 code to hidden_size // num_attention_heads",
    "rope_theta": "transformers' Qwen3Config defaults it to 10000, vLLM's Qwen3 code to 1000000",
}
"""Required: the two readers' defaults differ, so a missing value has no single meaning. Every
other field the model depends on has one default in both (transformers' Qwen3Config 4.51+ and
5.x, read as-is by vLLM): num_key_value_heads 32, rms_norm_eps 1e-6, tie_word_embeddings false,
hidden_act silu, attention_bias false, max_position_embeddings 32768 (rope table length only)."""

_MOE = "mixture of experts needs model_type qwen3_moe"
_QUANTIZED = "quantized weights; use an unquantized checkpoint"
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
"""Required in a qwen3_moe config.json: transformers' defaults (128, 8, 768) are placeholder sizes."""

_MUST_BE_UNSET = {
    "quantization_config": _QUANTIZED,
    "compression_config": _QUANTIZED,
    "shared_expert_intermediate_size": "shared experts are not part of Qwen3-MoE (transformers has none); remove it",
    "n_routed_experts": "DeepSeek-style routed experts are not Qwen3-MoE; remove it",
    "dual_chunk_attention_config": "dual-chunk attention is not supported; remove it",
    "attention_chunk_size": "chunked local attention is not supported; remove it",
}
"""Raw config.json fields (absent, null, 0 or empty are fine) for math the model does not have."""

_ONLY_VALUE = {
    "hidden_act": ("silu", "the MLP is SwiGLU"),
    "attention_bias": (False, "q/k/v/o projections have no bias"),
    "use_sliding_window": (False, "attention is full causal attention"),
    "attention_dropout": (0.0, "attention has no dropout"),
    "is_causal": (True, "attention is causal"),
}
"""Parsed fields -> (the one value the model computes, why). vLLM reads `is_causal` (default true)."""

_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


class ConfigError(ValueError):
    """A checkpoint's config.json is not a dense Qwen3 config this project supports."""


_DENSE_ONLY = {"num_experts": _MOE, "num_experts_per_tok": _MOE, "moe_intermediate_size": _MOE,
               "num_local_experts": _MOE}
"""Refused in a dense (`qwen3`) config.json."""


def hf_config_for_shape(shape: str, num_layers: int | None = None) -> dict:
    """The complete HF `config.json` dict for a named shape (optionally with fewer layers)."""
    if shape not in SHAPES:
        raise ConfigError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    spec = dict(SHAPES[shape])
    cfg = {**_COMMON, **(_MOE_COMMON if spec.pop("_moe", False) else {}), **spec}
    if num_layers is not None:
        if num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
        cfg["num_hidden_layers"] = num_layers
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    return cfg


def _short(value) -> str:
    """A config value as config.json spells it, cut to fit in a one-line message."""
    s = json.dumps(value, default=repr)
    return s if len(s) <= 60 else s[:57] + "..."


_MODEL_TYPES = {"qwen3": ("Qwen3ForCausalLM", Qwen3Config), "qwen3_moe": ("Qwen3MoeForCausalLM", Qwen3MoeConfig)}
"""model_type -> (the one architecture vLLM picks its model class by, transformers' config class)."""


def is_moe_config(cfg: dict) -> bool:
    return cfg.get("model_type") == "qwen3_moe"


def _check_raw(cfg: dict) -> None:
    """Refusals decided on config.json as written, before transformers fills in defaults."""
    model_type = cfg.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ConfigError(f"config.json has model_type={model_type!r}; only 'qwen3' (dense) and 'qwen3_moe' "
                          "are supported")
    archs, causal_lm = cfg.get("architectures"), [_MODEL_TYPES[model_type][0]]
    if archs not in (None, causal_lm):
        raise ConfigError(f"config.json has architectures={_short(archs)}; only {_short(causal_lm)} is supported "
                          f"for model_type {model_type}")
    required = _SHAPE_FIELDS + (_MOE_FIELDS if is_moe_config(cfg) else ())
    if is_moe_config(cfg) and cfg.get("num_experts") is None and cfg.get("num_local_experts") is not None:
        required = tuple(k for k in required if k != "num_experts")  # transformers' alias of num_experts
    missing = [k for k in required if cfg.get(k) is None]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}; set it explicitly")
    if cfg.get("head_dim") is None:
        raise ConfigError(f"config.json lacks head_dim ({_NO_SHARED_DEFAULT['head_dim']}); set it explicitly")
    refused = {**_MUST_BE_UNSET, **({} if is_moe_config(cfg) else _DENSE_ONLY)}
    for name, why in refused.items():
        if cfg.get(name) not in (None, 0, False, {}, []):
            raise ConfigError(f"config.json sets {name}={_short(cfg[name])}: {why}")
    _check_rope(cfg)


def _check_rope(cfg: dict) -> None:
    """Plain RoPE only, with one explicit rope_theta wherever the file puts it."""
    thetas = {"rope_theta": cfg["rope_theta"]} if "rope_theta" in cfg else {}
    factors = {"partial_rotary_factor": cfg["partial_rotary_factor"]} if "partial_rotary_factor" in cfg else {}
    for field in ("rope_parameters", "rope_scaling"):  # 5.x name, 4.x name
        params = cfg.get(field)
        if params in (None, {}):
            continue
        if not isinstance(params, dict):
            raise ConfigError(f"config.json has {field}={_short(params)}; expected an object or null")
        for key in ("rope_type", "type"):
            if params.get(key, "default") != "default":
                raise ConfigError(f"config.json sets {field}.{key}={_short(params[key])}; only plain RoPE "
                                  '(rope_type "default") is supported: use a checkpoint without RoPE scaling')
        unknown = sorted(set(params) - _ROPE_KEYS)
        if unknown:
            raise ConfigError(f"config.json {field} sets {', '.join(unknown)}; only plain RoPE "
                              '(rope_type "default", rope_theta) is supported: remove them')
        thetas.update({f"{field}.rope_theta": params["rope_theta"]} if "rope_theta" in params else {})
        factors.update({f"{field}.partial_rotary_factor": params["partial_rotary_factor"]}
                       if "partial_rotary_factor" in params else {})
    for where, factor in factors.items():
        if factor != 1:
            raise ConfigError(f"config.json sets {where}={_short(factor)}; only full rotary (1.0) is supported")
    if not thetas:
        raise ConfigError(f"config.json sets no rope_theta ({_NO_SHARED_DEFAULT['rope_theta']}); "
                          "set rope_parameters.rope_theta explicitly")
    for where, theta in thetas.items():
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise ConfigError(f"config.json has {where}={_short(theta)}; it must be a positive number")
    if len({float(t) for t in thetas.values()}) > 1:
        shown = ", ".join(f"{k}={v}" for k, v in thetas.items())
        raise ConfigError(f"config.json has conflicting {shown} (transformers 4.x and 5.x read different ones); "
                          "keep one")


def parse_hf_config(cfg: dict) -> Qwen3Config | Qwen3MoeConfig:
    """transformers' `Qwen3Config` (or `Qwen3MoeConfig`) of a config.json dict, after the refusals of
    `_check_raw`."""
    _check_raw(cfg)
    try:  # the parser normalizes nested dicts in place: give it a copy
        hf = _MODEL_TYPES[cfg["model_type"]][1].from_dict(copy.deepcopy(cfg))
    except Exception as e:  # noqa: BLE001 - strict-dataclass validation errors are not ValueErrors
        raise ConfigError(f"transformers cannot parse config.json: {' '.join(str(e).split())[:200]}") from None
    for field, (only, why) in _ONLY_VALUE.items():
        value = getattr(hf, field, only)
        if value != only:
            raise ConfigError(f"config.json sets {field}={_short(value)}, but only {_short(only)} is supported "
                              f"({why})")
    other = sorted(set(getattr(hf, "layer_types", None) or ()) - {"full_attention"})  # 4.51 has none
    if other:
        raise ConfigError(f"config.json layer_types contains {', '.join(map(_short, other))}; only "
                          '"full_attention" is supported')
    if hf.num_key_value_heads < 1 or hf.num_attention_heads % hf.num_key_value_heads:
        default = "" if "num_key_value_heads" in cfg else " (transformers' default; set it explicitly)"
        raise ConfigError(f"num_attention_heads={hf.num_attention_heads} is not a multiple of "
                          f"num_key_value_heads={hf.num_key_value_heads}{default}")
    if is_moe_config(cfg):
        _check_moe(hf)
    return hf


def _positive_int(hf, name: str) -> int:
    value = getattr(hf, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json has {name}={_short(value)}; it must be a positive integer")
    return value


def _check_moe(hf: Qwen3MoeConfig) -> None:
    """What a Qwen3-MoE config must hold for the sparse layers to be computed as vLLM computes them."""
    experts, top_k = _positive_int(hf, "num_experts"), _positive_int(hf, "num_experts_per_tok")
    _positive_int(hf, "moe_intermediate_size")
    _positive_int(hf, "decoder_sparse_step")
    if top_k > experts:
        raise ConfigError(f"config.json has num_experts_per_tok={top_k} > num_experts={experts}; a token cannot "
                          "take more experts than there are")
    only = hf.mlp_only_layers
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ConfigError(f"config.json has mlp_only_layers={_short(only)}; it must be a list of layer indices")
    outside = [i for i in only if not 0 <= i < hf.num_hidden_layers]
    if outside:
        raise ConfigError(f"config.json has mlp_only_layers={_short(only)}: layer {outside[0]} is not one of the "
                          f"{hf.num_hidden_layers} layers (0..{hf.num_hidden_layers - 1})")
    if not isinstance(hf.norm_topk_prob, bool):
        raise ConfigError(f"config.json has norm_topk_prob={_short(hf.norm_topk_prob)}; it must be true or false")
    coef = hf.router_aux_loss_coef
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
        raise ConfigError(f"config.json has router_aux_loss_coef={_short(coef)}; it must be a number >= 0")


def sparse_layer_ids(n_layers: int, decoder_sparse_step: int, mlp_only_layers) -> tuple[int, ...]:
    """Layers with experts: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, the rule of
    transformers' and vLLM's Qwen3-MoE."""
    return tuple(i for i in range(n_layers) if i not in set(mlp_only_layers) and (i + 1) % decoder_sparse_step == 0)


def _rope_theta(hf: Qwen3Config) -> float:
    """transformers >= 5 keeps rope_theta in `rope_parameters`, 4.x as a top-level attribute."""
    params = getattr(hf, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf, "rope_theta", None)))


@dataclass
class MoEModelArgs(Qwen3ModelArgs):
    """torchtitan's Qwen3 args for Qwen3-MoE (`moe_enabled`, `moe_inter_dim`, `moe_args` as torchtitan's own
    30B-A3B entry sets them) and what transformers' config adds to them."""

    sparse_layers: tuple[int, ...] = ()
    """Layers with a router and experts; the others have the dense MLP of width `hidden_dim`."""
    router_aux_loss_coef: float = 0.0
    """The config's load-balancing loss weight (transformers adds it to the loss only when asked;
    `--router-aux-loss` in SPIRL)."""


def sparse_layers(model_args) -> tuple[int, ...]:
    """The Qwen3-MoE layers with a router and experts (none for a dense Qwen3's args)."""
    return tuple(getattr(model_args, "sparse_layers", ()))


def is_moe(model_args) -> bool:
    """True for Qwen3-MoE args (some layer has experts)."""
    return bool(sparse_layers(model_args))


def model_args_from_hf_config(cfg: dict) -> Qwen3ModelArgs:
    """torchtitan args from an HF Qwen3 config dict; raises ConfigError on anything unsupported."""
    hf = parse_hf_config(cfg)
    dense = _dense_args(hf)
    if not is_moe_config(cfg):
        return Qwen3ModelArgs(**dense)
    sparse = sparse_layer_ids(hf.num_hidden_layers, hf.decoder_sparse_step, hf.mlp_only_layers)
    moe = MoEArgs(num_experts=hf.num_experts, num_shared_experts=0, top_k=hf.num_experts_per_tok,
                  score_func="softmax", route_norm=hf.norm_topk_prob, route_scale=1.0, score_before_experts=False,
                  load_balance_coeff=None)
    return MoEModelArgs(**dense, moe_enabled=bool(sparse), moe_inter_dim=hf.moe_intermediate_size, moe_args=moe,
                        sparse_layers=sparse, router_aux_loss_coef=float(hf.router_aux_loss_coef))


def _dense_args(hf) -> dict:
    return dict(
        dim=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads,
        n_kv_heads=hf.num_key_value_heads,
        vocab_size=hf.vocab_size,
        head_dim=hf.head_dim,
        hidden_dim=hf.intermediate_size,
        norm_eps=hf.rms_norm_eps,
        rope_theta=_rope_theta(hf),
        qk_norm=True,
        max_seq_len=hf.max_position_embeddings,
        enable_weight_tying=bool(hf.tie_word_embeddings),
    )


def _read_config_json(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path} not found; is {model_dir} a Hugging Face checkpoint directory?")
    if (Path(model_dir) / "hf_quant_config.json").is_file():  # vLLM reads quantization from here too
        raise ConfigError(f"{model_dir} has hf_quant_config.json (quantized weights); use an unquantized checkpoint")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


@dataclass(frozen=True)
class ModelDir:
    """A checkpoint directory whose config.json was read and checked once, with the model args it implies.

    The loaders (weights.load_hf_checkpoint, weights_vllm_compat.load_model) and the vLLM engine take
    it in place of the bare directory: building a policy passes the checkpoint through several of
    them, and each used to read, parse and check config.json again."""

    path: Path
    hf_config: dict
    """config.json as read."""
    args: Qwen3ModelArgs
    """The torchtitan model args it implies (every refusal of `model_args_from_hf_config` passed)."""

    @classmethod
    def read(cls, model_dir: str | Path) -> "ModelDir":
        """Read and check `<model_dir>/config.json`; ConfigError (one line) on anything unsupported."""
        hf_config = _read_config_json(model_dir)
        return cls(Path(model_dir), hf_config, model_args_from_hf_config(hf_config))


def load_hf_config(model_dir: str | Path) -> dict:
    """Read and validate `<model_dir>/config.json`."""
    return ModelDir.read(model_dir).hf_config
