"""What a policy is built from (spirl.core.build.build_policy_and_engine): the model, the compute dtype,
LoRA or full fine-tuning, the optimizer, the memory choices, and its rollout engine's settings.

The policy's own small spec, not a client's config: each client makes one from its own settings
(simple_rl.py from its command line, `TrainConfig.policy_spec`; the Tinker API from its backend
settings; the warm start from its few flags), so none builds another's config to get a policy.
Plain data, importing nothing at run time (the command line's config imports it before torch is
needed), so that the config, the policy and LoRA all import it. Its defaults are the one place for
these settings' defaults: TrainConfig and the Tinker backend's BackendConfig read theirs from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from torchtitan_compat.lora import LoRASpec


@dataclass
class LoRAInit:
    """A LoRA policy's adapters: their rank, alpha and targets (torchtitan_compat.lora.LoRASpec) and
    where they start."""

    spec: LoRASpec
    params: dict[str, torch.Tensor] | None = None
    """Adapter tensors to start from (--lora-init), else None: PEFT's initialization (B = 0)."""


@dataclass(frozen=True)
class EngineSpec:
    """The rollout engine the policy builds and keeps in step with its weights."""

    kind: str = "vllm"
    """`vllm` (GPU, VLLM_BATCH_INVARIANT=1) or `native` (plain PyTorch on the policy's own model, CPU ok)."""
    logprobs: str = "sampling"
    """Which distribution's logprobs it reports: `sampling` (the one that sampled) or `raw` (the raw
    logits'); spirl.numerics.parity.logprob_dist."""
    seed: int = 0
    """vLLM's seed (requests carry their own sampling seeds)."""
    gpu_memory_utilization: float = 0.35
    """vLLM's share of the GPU (its weights and KV cache); the trainer gets the rest."""
    max_model_len: int = 4096
    """Longest prompt + completion the engine accepts, in tokens."""
    eager: bool = False
    """vLLM without CUDA graphs (slower rollouts, same numbers)."""
    sleep_between_rollouts: bool = False
    """vLLM's sleep mode between rollouts (KV cache freed, weights to host memory while training)."""
    separate_gpus: int = 0
    """M > 0: the engine in a process of its own, on GPU trainer + M (--generation-gpus M: the node's M trainer
    ranks first, their engines after; spirl.core.rollout_engine.RemoteEngine); 0: in the trainer's process."""


@dataclass(frozen=True)
class PolicySpec:
    """The policy to build; see the module docstring."""

    model: str
    """The checkpoint as its user named it (a directory, a Hub repo id, `random:tiny`): what a LoRA
    adapter records as its base model. The directory itself is passed to the build, read once."""
    engine: EngineSpec = field(default_factory=EngineSpec)
    """The rollout engine's settings."""
    dtype: str = "bfloat16"
    """Compute dtype of the trainer's forward (vLLM computes in bfloat16; float32 on a CPU)."""
    lora: LoRAInit | None = None
    """LoRA adapters to train on the frozen base; None = full fine-tuning (fp32 masters of every weight)."""
    lr: float = 1e-5
    """AdamW's learning rate (a client may change it per step, as the Tinker API does)."""
    weight_decay: float = 0.0
    """AdamW's weight decay."""
    reference: bool = False
    """Keep the frozen initial policy, for a KL term (full fine-tuning: a copy of the weights; LoRA:
    the initial adapters)."""
    activation_checkpointing: bool = True
    """Keep only each decoder layer's input in the forward, recompute the layer in the backward."""
    lora_base: str = "host"
    """LoRA's frozen base of the adapted weights: `host` (pinned CPU memory, streamed in by each
    merge) or `gpu` (a second copy on the GPU: faster merges, more memory)."""
    seed: int = 0
    """Seed of the LoRA adapters' random initialization."""

    @property
    def backend(self) -> str:
        """The trainer's kernel backend (torchtitan_compat.select_backend): plain PyTorch beside the native engine,
        vLLM's kernels (where there are any: `auto`) beside vLLM."""
        return "reference" if self.engine.kind == "native" else "auto"
