"""The vLLM-compatible Qwen3 model built on torchtitan's Qwen3 args and conventions."""

from .config import ConfigError, SHAPES, hf_config_for_shape, model_args_from_hf_config
from .model import Qwen3VLLMCompatModel
from .backend_base import BackendError
from .ops import select_backend
from .packing import PackedTokens, pack

__all__ = [
    "ConfigError", "SHAPES", "hf_config_for_shape", "model_args_from_hf_config",
    "Qwen3VLLMCompatModel", "BackendError", "select_backend", "PackedTokens", "pack",
]
