"""Qwen3 shapes and the mapping between Hugging Face `config.json` and torchtitan's model args.

torchtitan's `Qwen3ModelArgs` is the one model config of the project; this module only translates
it to and from the Hugging Face `config.json` that checkpoints (and vLLM) read, and validates it.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchtitan.models.qwen3 import Qwen3ModelArgs

QWEN3_VOCAB_SIZE = 151936
"""Rows of Qwen3's embedding (the tokenizer uses 151669 of them; the rest is padding)."""

# Real Qwen3 config.json values (Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B) plus a tiny test shape that
# keeps the real vocabulary (so the real tokenizer's ids are valid) and Qwen3's head_dim of 128:
# with head_dim 64, vLLM's FA3 gave a decode row that differs from the same row computed in a
# prefill (measured on an H200), i.e. vLLM would not even agree with itself.
SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
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
}

_COMMON = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
    attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, hidden_act="silu",
    initializer_range=0.02, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_scaling=None,
    rope_theta=1000000, sliding_window=None, use_cache=True, use_sliding_window=False,
    vocab_size=QWEN3_VOCAB_SIZE, torch_dtype="bfloat16",
)


class ConfigError(ValueError):
    """A checkpoint's config.json is not a dense Qwen3 config this project supports."""


def hf_config_for_shape(shape: str, num_layers: int | None = None) -> dict:
    """The complete HF `config.json` dict for a named shape (optionally with fewer layers)."""
    if shape not in SHAPES:
        raise ConfigError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    cfg = {**_COMMON, **SHAPES[shape]}
    if num_layers is not None:
        if num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {num_layers}")
        cfg["num_hidden_layers"] = num_layers
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    return cfg


def model_args_from_hf_config(cfg: dict) -> Qwen3ModelArgs:
    """torchtitan args from an HF Qwen3 config dict; raises ConfigError on anything unsupported."""
    if cfg.get("model_type") != "qwen3":
        raise ConfigError(
            f"config.json has model_type={cfg.get('model_type')!r}; only dense 'qwen3' is supported"
        )
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "vocab_size") if k not in cfg]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}")
    if cfg.get("rope_scaling"):
        raise ConfigError("config.json sets rope_scaling; only plain RoPE is supported")
    if cfg.get("attention_bias"):
        raise ConfigError("config.json sets attention_bias; Qwen3 has none")
    n_heads = cfg["num_attention_heads"]
    return Qwen3ModelArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads", n_heads),
        vocab_size=cfg["vocab_size"],
        head_dim=cfg.get("head_dim", cfg["hidden_size"] // n_heads),
        hidden_dim=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", 1000000),
        qk_norm=True,
        max_seq_len=cfg.get("max_position_embeddings", 40960),
        enable_weight_tying=bool(cfg.get("tie_word_embeddings", False)),
    )


def load_hf_config(model_dir: str | Path) -> dict:
    """Read and validate `<model_dir>/config.json`."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path} not found; is {model_dir} a Hugging Face checkpoint directory?")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    model_args_from_hf_config(cfg)  # validates
    return cfg
