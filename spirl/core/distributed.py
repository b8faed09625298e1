"""Several GPUs (or CPU processes) under torchrun: FSDP2 or replicated-LoRA training, one rollout engine per rank.

    torchrun --nproc-per-node N simple_rl.py ...     (VLLM_BATCH_INVARIANT=1 for --engine vllm)

Under torchrun (RANK and WORLD_SIZE set) every process is one rank of a `World`; without it the
World is the one process and every collective below is the identity, so the trainer has one code
path. How a step is split, and why each piece keeps the one-GPU numbers:

* Prompts: every rank draws the step's prompts from the same seeded RNG and keeps the contiguous
  share `shard_of` gives it, whole groups included, so group-relative advantages need no
  communication. Each rank's engine samples its prompts with the per-prompt seed a one-GPU run
  passes; with batch-invariant kernels a prompt's samples do not depend on what else is in the
  batch, so N ranks draw exactly the tokens one GPU draws.
* Parity: every rank compares its own tokens, bit for bit; the counts are summed, and when any
  rank differs every rank raises ParityError naming the ranks (`raise_if_any`).
* Training: `fully_shard` (FSDP2) per decoder layer and on the root. The fp32 masters, their
  gradients and the AdamW state live sharded on dim 0. The forward all-gathers the compute-dtype
  cast of the masters; a cast is elementwise, so the gathered weights are bitwise the one-GPU
  compute model's, and the parity check proves it each step. Gradients are computed in the compute
  dtype (as on one GPU), reduce-scattered in fp32 and averaged over ranks; each rank's loss is its
  share of the mini-batch's loss (normalizers over every rank: spirl/loops/loss.py) times the number
  of ranks, so the average is the mini-batch's loss. Every rank must run the same number
  of forward and backward passes (each one is a sequence of collectives), so micro-batch counts
  are equalized with zero-weight passes (`spirl.loops.update.train_minibatch`).
* LoRA (spirl.core.lora): nothing is sharded. Every rank holds its engine's whole bf16 model and a
  replica of the adapters; `LoRAPolicy.reduce_grads` averages the adapters' gradients over ranks
  (one all-reduce) before the optimizer step, so the replicas stay bitwise equal (`check_replicas`
  at every checkpoint). The ranks of a host read the checkpoint in turns (`one_local_rank_at_a_time`).
* Weight sync: layer by layer, the compute-dtype tensors are gathered whole on every rank and
  loaded into that rank's engine; the fp32 model is never whole on a GPU (LoRA: the merge is the sync).
* Metrics are reduced here; rank 0 writes TensorBoard, metrics.jsonl and checkpoints. Checkpoints
  are the one-GPU format (gathered safetensors), so a run resumes on any number of GPUs.

Determinism: within one configuration the collectives are the only new arithmetic. All-gathers
copy bytes. A reduce-scatter of 2 ranks adds two numbers (exact, order-free) and averages by a
power of two (exact). For more ranks the summation order is NCCL's algorithm: `init_world`
pins it (NCCL_ALGO=Ring, NCCL_PROTO=Simple, unless set) so that it cannot change with message size
tuning between runs. NVLink SHARP (NCCL_NVLS_ENABLE) is left as the environment sets it. How the ranks
are spread over nodes changes nothing (on the CPU once the threads are pinned: `_pin_cpu_threads`).
Faults and preemption: spirl/core/faults.py, spirl/loops/run.py. Measurements: docs/distributed.md.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import EXIT_ENVIRONMENT, UserError

log = logging.getLogger("spirl.core.distributed")

DETERMINISTIC_NCCL = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
"""Fixed collective algorithm and protocol (set unless the user set them): see the module doc."""


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass
class World:
    """This process's place among the ranks; the collectives the trainer needs. The default is
    one process without torch.distributed (every collective returns its input)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    sharded: bool = False
    """True under torchrun (also with one rank): the trainer shards with FSDP2."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where collective tensors live (NCCL needs CUDA tensors)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives (identity on one process) -----------------------------------------------------

    def all_sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        if not self.sharded:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def all_max(self, value: float) -> float:
        if not self.sharded:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """The mean over ranks of each value (each rank's value a mean over the same number of
        sequences, so this is the mean over all of them)."""
        if not self.sharded:
            return dict(values)
        return dict(zip(values, (v / self.size for v in self.all_sum(list(values.values())))))

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: `t` becomes the element-wise sum over ranks (identical on every rank)."""
        if self.sharded:
            dist.all_reduce(t)
        return t

    def any(self, flag: bool) -> bool:
        return self.all_max(1.0 if flag else 0.0) > 0

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.sharded:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def raise_if_any(self, error: BaseException | None) -> None:
        """Collective: re-raise on every rank the first rank's error (an exception raised on one
        rank only would leave the others waiting in their next collective)."""
        errors = self.gather(None if error is None else (type(error), _args_of(error)))
        for r, e in enumerate(errors):
            if e is not None:
                if error is not None and r == self.rank:
                    raise error
                cls, args = e
                raise cls(*args)

    # -- sharded tensors ---------------------------------------------------------------------------

    def full_cpu(self, t: torch.Tensor) -> torch.Tensor | None:
        """Collective for a sharded tensor: the whole tensor on the CPU of rank 0 (None on the
        others). A plain tensor is returned as a detached CPU copy."""
        if not _is_dtensor(t):
            return t.detach().cpu().contiguous()
        full = t.detach().full_tensor()
        return full.cpu().contiguous() if self.is_main else None


def check_replicas(tensors: dict[str, torch.Tensor], world: World, what: str) -> None:
    """Collective: raise (a bug) unless every rank holds bit-identical `tensors` (replicated state, e.g.
    LoRA adapters): a sha256 of their bytes, in name order, compared over ranks."""
    if not world.sharded:
        return
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    digests = world.gather(h.hexdigest())
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(f"the {what} of rank(s) {differ} differ from rank 0's: the replicas diverged "
                           f"(every rank must take the same optimizer step)")


def _args_of(e: BaseException) -> tuple:
    if isinstance(e, UserError):
        return (str(e), e.exit_code)
    return e.args


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (the tensor itself otherwise)."""
    return t.to_local() if _is_dtensor(t) else t


def local_rows(t: torch.Tensor) -> slice | None:
    """The dim-0 rows of `t` this rank holds (FSDP2 shards dim 0 like torch.chunk); None when
    `t` is not sharded (or 0-dimensional)."""
    if not _is_dtensor(t) or t.dim() == 0:
        return None
    mesh = t.device_mesh
    size, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-t.shape[0] // size)
    start = min(rank * chunk, t.shape[0])
    rows = slice(start, min(start + chunk, t.shape[0]))
    if rows.stop - rows.start != t.to_local().shape[0]:
        raise RuntimeError(f"shard of rank {rank}: expected rows {rows} of {list(t.shape)}, "
                           f"holds {list(t.to_local().shape)}")
    return rows


def like(local_tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A tensor holding this rank's `local_tensor`, sharded like `param` (plain if param is)."""
    if not _is_dtensor(param):
        return local_tensor
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local_tensor.to(param.device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride())


def even_slices(n: int, parts: int) -> list[slice]:
    """`parts` consecutive slices of n items whose sizes differ by at most one (all equal when `parts` divides
    n; some empty when n < parts): part i runs from floor(n i / parts) to floor(n (i + 1) / parts)."""
    return [slice(n * i // parts, n * (i + 1) // parts) for i in range(parts)]


def shard_of(items: list, world: World) -> list:
    """Rank r's contiguous share of `items` (whose length the ranks divide)."""
    n = len(items) // world.size
    return items[world.rank * n:(world.rank + 1) * n]


TURN_TIMEOUT = timedelta(hours=2)
"""How long a rank waits for the ranks before it in `one_local_rank_at_a_time` (a dead one is found sooner by
spirl.core.faults)."""


def job_store():
    """A client of the job's c10d store (torchrun's TCPStore at MASTER_ADDR:MASTER_PORT, or rank 0's), a
    connection of its own: usable from any thread, and waits on it are not collectives (no NCCL timeout)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=30), wait_for_workers=False)


def job_key(name: str) -> str:
    """A store key of this job's current attempt (torchrun's run id and restart count)."""
    return "spirl/{}/{}/{}".format(os.environ.get("TORCHELASTIC_RUN_ID", "run"),
                                   os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), name)


def one_local_rank_at_a_time(world: World, fn, store=None):
    """Collective: `fn()` run by the ranks of each host one after another (by local rank); returns this
    rank's result once every rank's is done. For work whose host memory peaks (reading a checkpoint): N
    ranks of a host then need one peak, not N at once. The waits are on the job's store, not NCCL
    collectives, so no collective timeout limits how long the turns take. `fn` must not be collective."""
    if not world.sharded:
        return fn()
    import socket

    store = store or job_store()
    host = socket.gethostname()
    if world.local_rank:
        store.wait([job_key(f"turn/{host}/{world.local_rank - 1}")], TURN_TIMEOUT)
    out = fn()
    store.set(job_key(f"turn/{host}/{world.local_rank}"), "1")
    store.set(job_key(f"turn-done/{world.rank}"), "1")
    store.wait([job_key(f"turn-done/{r}") for r in range(world.size)], TURN_TIMEOUT)
    return out


def gathered_weight_groups(model: torch.nn.Module, dtype: torch.dtype):
    """Collective: the model's weights cast to `dtype` and gathered whole, one group at a time (the
    embedding, each decoder layer, the rest), as {name: tensor} dicts. Casting the local shard
    before gathering is the same elementwise rounding as casting the whole tensor, at half the
    traffic for bf16."""
    from .metrics import layer_of

    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        groups.setdefault(layer_of(name), []).append((name, p))
    for members in groups.values():
        out = {}
        for name, p in members:
            t = p.detach().to(dtype)
            out[name] = t.full_tensor() if _is_dtensor(t) else t
        yield out


# -- setup -----------------------------------------------------------------------------------------


def init_world(device: torch.device) -> World:
    """The World of this process: under torchrun, join the process group (NCCL on CUDA, gloo on the
    CPU) with this rank's GPU set as the current device; otherwise the single process."""
    if not launched_by_torchrun():
        return World(device=device)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise UserError(f"torchrun rank {rank} has LOCAL_RANK {local_rank} but only {visible} GPU(s) are visible; "
                            f"pass --nproc-per-node {visible} or fewer", EXIT_ENVIRONMENT)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        for k, v in DETERMINISTIC_NCCL.items():
            os.environ.setdefault(k, v)
        backend = "nccl"
    else:
        backend = "gloo"
        _pin_cpu_threads()
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    world = World(rank, size, local_rank, True, device)
    if not world.is_main:  # one console: the other ranks log warnings and errors only
        for name in ("", "spirl", "torchtitan_compat", "weights", "vllm"):
            logging.getLogger(name).setLevel(logging.WARNING)
    log.info("torchrun: %d rank(s), backend %s, this is rank %d on %s", size, backend, rank, device)
    return world


def _pin_cpu_threads() -> None:
    """On the CPU the trainer's numbers depend on torch's intra-op thread count (a GEMM split over
    more threads sums in another order). torchrun sets OMP_NUM_THREADS=1 for its workers only when a
    node runs several of them, so 2 nodes x 1 rank computed other bits than 1 node x 2 ranks. A rank
    on the CPU therefore uses one thread unless OMP_NUM_THREADS says otherwise, however the ranks are
    spread over nodes (GPU kernels do not depend on it)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
        log.info("CPU rank: 1 intra-op thread (as torchrun sets for several ranks per node); set "
                 "OMP_NUM_THREADS to choose, the same on every node")


def check_distributed_config(cfg, world: World) -> None:
    """What a run on several ranks needs of the config, refused in one line: each rank samples
    whole groups, so the prompts of a step divide by the ranks (the held-out eval may split
    unevenly)."""
    from .config import ConfigError

    if cfg.prompts_per_step % world.size:
        raise ConfigError(f"--prompts-per-step {cfg.prompts_per_step} does not split over {world.size} ranks "
                          f"(each rank samples whole groups); pass a multiple of {world.size}")
    if cfg.prompts_per_round % world.size:
        raise ConfigError(f"--oversample {cfg.oversample:g} makes rounds of {cfg.prompts_per_round} prompts, which "
                          f"do not split over {world.size} ranks; choose it so that --prompts-per-step x oversample "
                          f"is a multiple of {world.size}")
    per_rank = cfg.prompts_per_step // world.size * cfg.group_size
    if per_rank % cfg.updates_per_batch:
        raise ConfigError(f"--updates-per-batch {cfg.updates_per_batch} does not divide the {per_rank} sequences "
                          f"each of {world.size} ranks trains on; pass a divisor of {per_rank}")


def check_distributed_task(task, cfg, world: World) -> None:
    """The multi-turn retokenization detector scores a varying number of sequences per rank, which
    a sharded model cannot (every forward is a collective): refused in one line under torchrun."""
    from .config import ConfigError

    if world.sharded and getattr(task, "multi_turn", False) and cfg.detect_retokenization:
        raise ConfigError("--detect-retokenization 1 runs in one process only; under torchrun pass "
                          "--detect-retokenization 0 (the rollouts are token-in/token-out either way)")


def shard_model(model: torch.nn.Module, world: World, compute_dtype: torch.dtype) -> torch.nn.Module:
    """fully_shard each decoder layer and the root (FSDP2, torchtitan's layout), computing in
    `compute_dtype` with fp32 gradient reduction. `token_logprobs` (the trainer's forward) runs
    with the root's weights gathered, like `forward`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    mesh = init_device_mesh(world.device.type, (world.size,))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    register_fsdp_forward_method(model, "token_logprobs")
    return model
