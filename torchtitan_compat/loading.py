"""Build a Qwen3VLLMCompatModel from a Hugging Face checkpoint directory (safetensors only)."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import model_args_from_hf_config
from .model import Qwen3VLLMCompatModel


def load_model(model_dir: str | Path, device="cpu", dtype=torch.float32,
               backend: str | object = "auto") -> Qwen3VLLMCompatModel:
    """Load `model_dir` (validated by weights.load_hf_checkpoint) into the merged compat layout."""
    import weights
    import weights_vllm_compat

    hf_config, hf_sd = weights.load_hf_checkpoint(model_dir)
    args = model_args_from_hf_config(hf_config)
    compat_sd = weights_vllm_compat.hf_to_compat(hf_sd, args)
    with torch.device("meta"):
        model = Qwen3VLLMCompatModel(args, backend="reference")
    model.backend = _resolve_backend(backend, device)
    model.load_state_dict(compat_sd, strict=True, assign=True)
    return model.to(device=device, dtype=dtype)


def _resolve_backend(backend, device):
    from .ops import select_backend

    return select_backend(backend, device) if isinstance(backend, str) else backend
