"""The policy's one entry: `build_policy_and_engine`, full fine-tuning (spirl.core.policy) or LoRA
(spirl.core.lora), each with its rollout engine.

Its own module because the choice needs both kinds: the LoRA policy is a Policy (lora.py imports
policy.py), so choosing it in policy.py would make policy.py import lora.py back, a circle.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import lora, policy
from .config import TrainConfig
from .distributed import World


def build_policy_and_engine(model_dir: Path, cfg: TrainConfig, device: torch.device, world: World | None = None,
                            init: lora.LoRAInit | None = None):
    """(policy, engine): full fine-tuning (fp32 masters, a compute copy, the engine's own copy), or
    with `init` (spirl.core.lora.LoRAInit) a LoRA policy sharing the engine's weights."""
    world = world or World(device=device)
    if init is not None:
        return lora.build_lora_policy_and_engine(model_dir, cfg, device, world, init)
    built = policy.build_policy(model_dir, cfg, device, world)
    return built, policy.build_engine(cfg, model_dir, built)
