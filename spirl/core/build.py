"""The policy's one entry: `build_policy_and_engine`, the policy a PolicySpec (spirl.core.spec) describes,
full fine-tuning (spirl.core.policy) or LoRA (spirl.core.lora), with its rollout engine.

Its own module because the choice needs both kinds: the LoRA policy is a Policy (lora.py imports
policy.py), so choosing it in policy.py would make policy.py import lora.py back, a circle. The
checkpoint comes as a ModelDir, its config.json read and checked once by the caller (a client's
preflight, spirl.core.preflight.validate_model_dir) and passed down to every loader and the engine.
"""

from __future__ import annotations

import torch

from torchtitan_compat.config import ModelDir

from . import lora, policy
from .distributed import World
from .spec import PolicySpec


def build_policy_and_engine(model: ModelDir, spec: PolicySpec, device: torch.device, world: World | None = None):
    """(policy, engine): full fine-tuning (fp32 masters, a compute copy, the engine's own copy), or
    with `spec.lora` a LoRA policy sharing the engine's weights."""
    world = world or World(device=device)
    if spec.lora is not None:
        return lora.build_lora_policy_and_engine(model, spec, device, world)
    built = policy.build_policy(model, spec, device, world)
    return built, policy.build_engine(spec.engine, model, built)
