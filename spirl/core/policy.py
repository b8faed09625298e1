"""The policy: the weights training updates, the model the trainer computes with, the rollout engine
that samples from them, and keeping the two in step. The core that both GRPO (spirl/loops/trainer.py,
spirl/loops/run.py) and the Tinker API (spirl/tinker/) train through.

Full fine-tuning: AdamW updates fp32 *master* weights; the trainer's forward runs a compute-dtype
model whose parameters are the cast of the masters (copied after every optimizer step). Gradients
flow into the compute model and are accumulated into the masters' .grad in fp32. The engine
receives the compute model's tensors, i.e. exactly the numbers the trainer's forward uses
(`sync_weights`). LoRA (spirl/core/lora.py): the masters are the adapters, and the engine computes
with the trainer's own merged weights. Both are built from a PolicySpec (spirl/core/spec.py); which
of the two a run gets is chosen in spirl/core/build.py.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from torchtitan_compat.config import ModelDir

from . import checkpoint as ckpt
from .distributed import World, gathered_weight_groups, shard_model
from .optim import build_adamw
from .rollout_engine import EOS_IDS, EngineProcess, RemoteEngine, make_engine, own_decoder  # noqa: F401 - EOS_IDS
from .spec import EngineSpec, PolicySpec

log = logging.getLogger("spirl.core.policy")


@dataclass
class Policy:
    """fp32 masters (what AdamW updates), the compute model (their cast), the frozen reference
    (None when the loss has no KL term). Sharded (`world.sharded`, under torchrun): `model` is the
    FSDP2 module whose parameters *are* the masters, computing in the compute dtype (see
    spirl.core.distributed), so there is nothing to push or accumulate by hand."""

    masters: dict[str, torch.nn.Parameter]
    model: torch.nn.Module
    ref: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    world: World = field(default_factory=World)
    compute_dtype: torch.dtype = torch.float32
    shards_model = True
    """Under torchrun the model is FSDP2-sharded over the ranks (full fine-tuning). False for LoRA: every
    rank holds the whole frozen model (its engine's) and a replica of the adapters (spirl.core.lora)."""
    engine_shares_weights = False
    """True when the engine computes with the model's own weight tensors (LoRA, spirl.core.lora): the
    weight sync is then the merge `push_masters_to_model` does, and nothing is loaded."""
    merge_phase = "optimizer"
    """The timing phase `push_masters_to_model` is counted in."""

    @property
    def fsdp(self) -> bool:
        """The model is sharded over several ranks by FSDP2: every forward and backward is a sequence of
        collectives (so every rank must run as many), and FSDP reduces the gradients itself."""
        return self.world.sharded and self.shards_model

    @property
    def has_reference(self) -> bool:
        return self.ref is not None

    @contextmanager
    def reference_model(self):
        """The frozen initial policy, for reference logprobs (only when there is a KL term)."""
        yield self.ref

    @torch.no_grad()
    def push_masters_to_model(self) -> None:
        if self.fsdp:  # FSDP casts the masters at every all-gather
            return
        for name, p in self.model.named_parameters():
            p.copy_(self.masters[name])  # cast to the compute dtype

    def grads_to_masters(self) -> None:
        """Accumulate the compute model's grads into the masters' fp32 .grad, then clear them
        (sharded: FSDP has reduce-scattered them into the masters' .grad already)."""
        if self.fsdp:
            return
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            m = self.masters[name]
            g = p.grad.to(torch.float32)
            m.grad = g.clone() if m.grad is None else m.grad.add_(g)
            p.grad = None

    def release_gathered(self) -> None:
        """Sharded: free the weights FSDP2 keeps gathered after a forward. Its root module keeps them after
        every forward (a backward usually follows, which frees them); after a no-grad forward between a backward
        and the optimizer step (--off-policy-steps' parity check) the next forward and the weight sync would
        read that stale gathered copy instead of the updated shards."""
        if not self.fsdp:
            return
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def _forward_tensors(self):
        """(name, tensor) of what the forward reads, as views: the compute model's parameters (sharded: this rank's
        shards of the masters, which FSDP2 gathers and casts)."""
        for name, p in self.model.named_parameters():
            yield name, (p.to_local() if self.fsdp else p).detach()

    @torch.no_grad()
    def keep_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the weights the forward reads now (for `weights_of` after the optimizer has moved them)."""
        return {name: t.clone() for name, t in self._forward_tensors()}

    @contextmanager
    def weights_of(self, kept: dict[str, torch.Tensor]):
        """The model computing with `kept` (from keep_weights) inside the block, its own weights again after it:
        the two are exchanged in place, tensor by tensor, and exchanged back."""
        self._exchange(kept)
        try:
            yield
        finally:
            self.release_gathered()  # sharded: the gathered copy is of the kept weights
            self._exchange(kept)

    @torch.no_grad()
    def _exchange(self, kept: dict[str, torch.Tensor]) -> None:
        for name, t in self._forward_tensors():
            held = t.clone()
            t.copy_(kept[name])
            kept[name].copy_(held)

    def reduce_grads(self) -> None:
        """Before the optimizer step: make the masters' gradients those of the loss over every rank's
        samples. Nothing to do on one process, nor under FSDP (its backward reduce-scatters them)."""


def build_policy(model: ModelDir, spec: PolicySpec, device: torch.device, world: World | None = None) -> Policy:
    """The full fine-tuning policy of `spec` (spec.lora is not looked at: spirl.core.build chooses). One process:
    fp32 masters on `device` and their compute-dtype cast; sharded (torchrun): each rank reads the checkpoint on
    its CPU and fully_shard moves each layer's shard to its GPU, the masters being the FSDP2 module's own."""
    from weights_vllm_compat import load_model

    from torchtitan_compat import select_backend

    world = world or World(device=device)
    dtype = getattr(torch, spec.dtype)
    backend = select_backend(spec.backend, device, model.args)
    fp32 = load_model(model, device="cpu" if world.sharded else device, dtype=torch.float32, backend=backend)
    fp32.activation_checkpointing = spec.activation_checkpointing
    if world.sharded:
        ref = shard_model(copy.deepcopy(fp32).to(dtype).requires_grad_(False), world, dtype) if spec.reference else None
        compute = shard_model(fp32, world, dtype)
        masters = dict(compute.named_parameters())
    else:
        # deepcopy first: .to() of a float32 model to float32 would otherwise share the masters' storage
        compute = copy.deepcopy(fp32).to(dtype)
        ref = copy.deepcopy(compute).requires_grad_(False) if spec.reference else None
        masters = dict(fp32.named_parameters())
    return Policy(masters, compute, ref, build_adamw(masters, spec.lr, spec.weight_decay), world, dtype)


def build_engine(engine: EngineSpec, model: ModelDir, policy: Policy | None, world: World | None = None,
                 **engine_settings):
    """The rollout engine: native (on the policy's model) or vLLM (`engine_settings` go to
    VLLMEngineConfig, e.g. LoRA's placeholder weights). `world`: the ranks (default: the policy's);
    under torchrun each rank gets an engine of its own (vLLM's external launcher, tensor parallel 1).
    `engine.separate_gpus` M (--generation-gpus M): in a process of its own, on GPU trainer + M
    (spirl.core.rollout_engine.RemoteEngine)."""
    world = world or (policy.world if policy is not None else World())
    if engine.separate_gpus:
        device = _engine_device(world.device, engine.separate_gpus)
        remote = RemoteEngine(EngineProcess(engine, str(model.path), device, policy.compute_dtype))
        if engine.kind == "vllm":  # this process computes as if it held the engine (after the weight group's set-up)
            from ..engines.vllm_engine import process_wide_settings

            process_wide_settings()
        return remote
    decoder = None
    if engine.kind == "native":  # under FSDP2 on its own whole copy (weights synced into it)
        decoder = own_decoder(model, policy.world.device, policy.compute_dtype) if policy.fsdp else policy.model
    return make_engine(engine, model, decoder, world, **engine_settings)


def _engine_device(trainer: torch.device, engine_gpus: int) -> str:
    """The engine's own device: GPU trainer index + `engine_gpus` (the node's trainer ranks come first, their
    engines after them), or the CPU beside a CPU trainer."""
    from .errors import UserError

    if trainer.type != "cuda":
        return "cpu"
    index = (trainer.index or 0) + engine_gpus
    if index >= torch.cuda.device_count():
        raise UserError(f"--generation-gpus {engine_gpus} puts this rank's engine on cuda:{index}, but "
                        f"{torch.cuda.device_count()} GPU(s) are visible: make twice the trainer ranks' GPUs visible "
                        "or set --generation-gpus 0")
    return f"cuda:{index}"


def sync_weights(engine, policy: Policy, spec: PolicySpec) -> None:
    """Load the compute model's tensors (the trainer's exact forward weights) into the engine;
    sharded: gathered whole one layer at a time, on every rank, into that rank's engine."""
    import weights_vllm_compat

    if policy.engine_shares_weights:  # the merge after the optimizer step wrote the engine's tensors
        return
    if policy.fsdp:
        groups = gathered_weight_groups(policy.model, policy.compute_dtype)
    else:
        groups = [{k: v.detach() for k, v in policy.model.named_parameters()}]
    for group in groups:
        if spec.engine.kind == "native":
            engine.load_weights(group.items())
        else:
            engine.load_weights(weights_vllm_compat.compat_part_to_hf(group, policy.model.args))


# -- checkpoints -----------------------------------------------------------------------------------


def _shard_rows(policy: Policy):
    """For ckpt.load: the rows of each saved tensor this rank holds (None: all of it)."""
    from .distributed import local_rows

    params = list(policy.masters.values())

    def rows(key: str):
        head, _, name = key.partition(".")
        if head.isdigit() and name:  # optimizer state "<param index>.<name>"; `step` is a scalar
            return None if name == "step" or int(head) >= len(params) else local_rows(params[int(head)])
        return local_rows(policy.masters[key]) if key in policy.masters else None
    return rows


def resume_into(policy: Policy, path: str, device) -> int:
    """Load a checkpoint (masters or adapters, AdamW state, RNG states) into `policy` and push the
    masters into the model; returns the checkpoint's step. Bit-exact: a resumed run repeats the
    uninterrupted one."""
    from .distributed import like, local

    sharded = policy.fsdp
    state, masters, opt_state = ckpt.load(path, device, _shard_rows(policy) if sharded else None)
    d = ckpt.resolve(path)
    with torch.no_grad():
        for name, p in policy.masters.items():
            if name not in masters or masters[name].shape != local(p).shape:
                raise ckpt.CheckpointError(f"--resume {d}: {name} does not match the model; resume with the "
                                           "--model that run used")
            local(p).copy_(masters[name])
    if sharded:  # the optimizer's state tensors are sharded like their parameters
        params = [p for group in policy.optimizer.param_groups for p in group["params"]]
        for i, st in opt_state["state"].items():
            if i < len(params):
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st and st[k].shape == local(params[i]).shape:
                        st[k] = like(st[k], params[i])
    try:
        policy.optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise ckpt.CheckpointError(f"--resume {d}: its optimizer state does not fit this run "
                                   f"({' '.join(str(e).split())}); pass another checkpoint") from None
    for group in policy.optimizer.param_groups:
        for p in group["params"]:
            for k in ("exp_avg", "exp_avg_sq"):
                t = policy.optimizer.state.get(p, {}).get(k)
                if t is not None and local(t).shape != local(p).shape:
                    raise ckpt.CheckpointError(f"--resume {d}: its optimizer state has shape {list(t.shape)} for a "
                                               f"parameter of shape {list(p.shape)}; pass another checkpoint")
    policy.push_masters_to_model()
    note = ckpt.restore_rng(state)
    if note:
        log.info("resume: %s", note)
    log.info("resumed from %s at step %d (written by %s rank(s), resumed on %d)", d, state["step"],
             state.get("world_size", "?"), policy.world.size)
    return int(state["step"])
