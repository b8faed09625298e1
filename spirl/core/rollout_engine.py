"""Building the rollout engine, in the trainer's process or in a process of its own (--generation-gpus M: each of
the node's M trainer ranks on its GPU, its engine on GPU local_rank + M; one process: the engine on the next GPU;
on a machine without CUDA, a second process on the CPU).

`make_engine` builds the engine an EngineSpec names (native, on a decoder model; or vLLM); spirl.core.policy
chooses the decoder and where the engine runs.

`RemoteEngine` stands where an engine stands: the loop calls `generate`, `sample`, `load_weights` and `close` on
it, and each call runs in the engine's process (`_serve`), one at a time, in the order made. Nothing else changes:
with --off-policy-steps K the loop's background thread waits for `generate` while the trainer computes on its own
GPU (the overlap one GPU cannot give, docs/async-grpo.md), and the weight sync after each update sends the
trainer's exact weights, which the engine loads before its next call. What is sampled depends on those weights,
the requests and their seeds, never on timing: a run is the colocated run, bit for bit (tests/test_remote_engine.py).

Transport: calls and their answers (the samples' logprobs and routes) over Python's multiprocessing (spawn) pipe,
with torch's tensor pickling. The weights go GPU to GPU: trainer and engine process form a two-rank process group
of their own (NCCL; gloo between CPU processes), built beside any the trainer's ranks have (torchrun's world is not
touched); `load_weights` sends the tensors' names, shapes and dtypes over the pipe and the tensors over the group,
and the engine loads them a chunk of at most WEIGHT_CHUNK_BYTES at a time, so its GPU holds one chunk beyond its
weights.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
from dataclasses import dataclass, replace
from datetime import timedelta

import torch

log = logging.getLogger("spirl.core.rollout_engine")

METHODS = ("generate", "sample", "greedy")
"""The engine calls forwarded to the engine's process as they are (load_weights sends its tensors over the group)."""

WEIGHT_CHUNK_BYTES = 1 << 30
"""The weight sync's chunk: the engine receives and loads at most this much at a time (one tensor if larger)."""

GROUP_TIMEOUT = timedelta(minutes=30)
"""How long either side of the weight group waits for the other (a weight sync, the group's set-up)."""


@dataclass(frozen=True)
class EngineProcess:
    """What the engine's process builds: spirl.core.policy.build_engine's inputs, picklable."""

    engine: object
    """The EngineSpec."""
    model_dir: str
    """The checkpoint directory (its config.json is read again in the engine's process)."""
    device: str
    """The engine's device: `cuda:N` (its own GPU) or `cpu`."""
    dtype: torch.dtype
    """The native engine's compute dtype (the trainer's)."""
    group_port: int = 0
    """The port of the weight group's store, on this host (the trainer's process holds it)."""
    visible: str = ""
    """The engine's process's CUDA_VISIBLE_DEVICES (its GPU first), set by the trainer's process."""


class RemoteEngineError(RuntimeError):
    """The engine's process failed or died; one line saying which call and why."""


def _engine_first(index: int) -> str:
    """CUDA_VISIBLE_DEVICES for the engine's process: the trainer's visible GPU `index` first (the engine's
    cuda:0, where vLLM runs), the others after it, so that NCCL sees the trainer's GPU too."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    return ",".join([entries[index]] + entries[:index] + entries[index + 1:])


EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|> (Qwen3's generation_config eos_token_id)


def make_engine(engine, model, decoder=None, world=None, **engine_settings):
    """The rollout engine `engine` (an EngineSpec) names: native, decoding with `decoder` (a compat model), or
    vLLM on `model` (a ModelDir; `engine_settings` go to VLLMEngineConfig, e.g. LoRA's placeholder weights; under
    torchrun, `world.sharded`, vLLM's external launcher, tensor parallel 1)."""
    if engine.kind == "native":
        from ..engines.native_engine import NativeEngine

        return NativeEngine(decoder, EOS_IDS, logprobs=engine.logprobs)
    from ..engines.vllm_engine import VLLM_LOGPROBS_MODE, VLLMEngine, VLLMEngineConfig

    return VLLMEngine(VLLMEngineConfig(
        str(model.path), seed=engine.seed, gpu_memory_utilization=engine.gpu_memory_utilization,
        max_model_len=engine.max_model_len, cuda_graphs="none" if engine.eager else VLLMEngineConfig.cuda_graphs,
        logprobs_mode=VLLM_LOGPROBS_MODE[engine.logprobs], sleep_between_rollouts=engine.sleep_between_rollouts,
        external_launcher=world is not None and world.sharded, model_args=model.args, **engine_settings))


def own_decoder(model, device, dtype: torch.dtype):
    """A native engine's own frozen copy of the checkpoint's model (plain PyTorch kernels, as the trainer beside a
    native engine computes), for an engine that cannot decode on the trainer's model (FSDP2 shards, another
    process); the trainer's weights arrive with the weight sync."""
    from weights_vllm_compat import load_model

    return load_model(model, device=device, dtype=dtype, backend="reference").requires_grad_(False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weight_group(port: int, rank: int, device: str):
    """The two-rank process group of the trainer (rank 0, which holds the store) and its engine (rank 1), set up
    by a one-element transfer from rank 0 to rank 1; `device`: this process's (NCCL between GPUs, gloo between CPU
    processes). Built on its own store, so it is not torchrun's world.

    The engine's process builds it when it starts, before vLLM is imported there: vLLM's batch-invariant mode sets
    NCCL's environment for its own collectives (one channel, NCCL_PROTO and the like), a communicator takes NCCL's
    environment when it is set up, and two ranks set up with different settings hang on their first transfer (seen
    on two H200s: 32 channels in the trainer's process, 1 in the engine's)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, GROUP_TIMEOUT, wait_for_workers=False)
    if device.startswith("cuda"):
        group = dist.ProcessGroupNCCL(store, rank, 2)
    else:
        group = dist.ProcessGroupGloo(store, rank, 2, GROUP_TIMEOUT)
    one = torch.zeros(1, device=device)
    (group.send([one], 1, 0) if rank == 0 else group.recv([one], 0, 0)).wait()
    return store, group


def _shut(group, seconds: float = 60.0) -> None:
    """Shut the weight group down, waiting at most `seconds`. Each side calls it after the engine has answered
    `close`, so the two finalize at the same time: torch's ProcessGroupNCCL.shutdown finalizes the communicator,
    which may wait for the peer's (one side shutting down before answering, the other after the answer, hung the
    exit of a 1 + 1 run on two H200s). Past `seconds` the process goes on; its exit frees what is left."""
    done = threading.Thread(target=group.shutdown, name="spirl-weight-group-shutdown", daemon=True)
    done.start()
    done.join(seconds)
    if done.is_alive():
        log.warning("the weight group did not shut down within %.0f s; leaving it to the process's exit", seconds)


def _chunks(named_tensors, limit: int = WEIGHT_CHUNK_BYTES) -> list[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs in order, cut into runs of at most `limit` bytes (a larger tensor alone)."""
    chunks, size = [[]], 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if chunks[-1] and size + n > limit:
            chunks.append([])
            size = 0
        chunks[-1].append((name, t.detach().contiguous()))
        size += n
    return [c for c in chunks if c]


def _receive_weights(engine, group, device: str, layout) -> float:
    """The engine's side of load_weights: each chunk received over the group, then loaded; seconds loading."""
    seconds = 0.0
    for chunk in layout:
        tensors = [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype in chunk]
        for t in tensors:
            group.recv([t], 0, 0).wait()
        seconds += engine.load_weights(zip([name for name, _, _ in chunk], tensors)) or 0.0
    return seconds


def _build(p: EngineProcess):
    """The engine of the engine's process (a native one on its own decoder)."""
    from torchtitan_compat.config import ModelDir

    model = ModelDir.read(p.model_dir)
    decoder = own_decoder(model, torch.device(p.device), p.dtype) if p.engine.kind == "native" else None
    return make_engine(p.engine, model, decoder)


def _serve(conn, p: EngineProcess) -> None:
    """The engine's process: build the engine, then answer calls until `close` (or the trainer goes away)."""
    if p.device.startswith("cuda"):
        os.environ["CUDA_VISIBLE_DEVICES"] = p.visible
        p = replace(p, device="cuda:0")
    conn.send(("joining", None))
    _store, group = _weight_group(p.group_port, 1, p.device)  # before vLLM sets its NCCL environment here
    try:
        engine = _build(p)
    except BaseException as e:  # noqa: BLE001 - reported to the trainer, one line
        conn.send(("error", f"building the engine: {type(e).__name__}: {e}"))
        return
    budget = getattr(engine, "prefill_budget", None)  # vLLM's token budget, for the precompile's warm-up
    conn.send(("ok", None if budget is None else budget()))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:  # the trainer's process ended
            break
        if method == "close":
            engine.close()
            conn.send(("ok", None))
            _shut(group)  # with the trainer's side: NCCL's finalize may wait for the peer's
            break
        try:
            if method == "load_weights":
                conn.send(("ok", _receive_weights(engine, group, p.device, *args)))
                continue
            conn.send(("ok", getattr(engine, method)(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - reported to the trainer, one line
            conn.send(("error", f"{method}: {type(e).__name__}: {e}"))


class RemoteEngine:
    """An engine (spirl.core.policy.build_engine's) running in a process of its own (module docstring)."""

    samples_beside_training = True
    """Its sampling runs beside the trainer's computation (spirl.loops.ahead.Background)."""

    def __init__(self, process: EngineProcess):
        import multiprocessing

        import torch.multiprocessing  # noqa: F401 - registers torch's tensor pickling with multiprocessing's

        ctx = multiprocessing.get_context("spawn")
        process = replace(process, group_port=_free_port(), visible=_engine_first(torch.device(process.device).index)
                          if process.device.startswith("cuda") else "")
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()
        self.device = process.device
        # not a daemon: vLLM starts processes of its own (a daemon may not); if the trainer dies, the engine's
        # process reads EOF and ends
        self._proc = ctx.Process(target=_serve, args=(child, process), name="spirl-engine", daemon=False)
        self._proc.start()
        child.close()
        atexit.register(self.close)  # runs before multiprocessing joins its children at exit (atexit is LIFO)
        self._answer("starting the engine's process")  # "joining": its side of the weight group comes next
        here = f"cuda:{torch.cuda.current_device()}" if process.device.startswith("cuda") else "cpu"
        self._store, self._group = _weight_group(process.group_port, 0, here)
        self._budget = self._answer("starting the engine")
        log.info("rollout engine (%s) in a process of its own on %s (pid %d)", process.engine.kind, process.device,
                 self._proc.pid)

    def _answer(self, what: str):
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RemoteEngineError(f"the engine's process (on {self.device}) died during {what} "
                                    f"(exit code {self._proc.exitcode}); its log above says why") from None
        if status == "error":
            raise RemoteEngineError(f"the engine's process (on {self.device}) failed: {value}")
        return value

    def _call(self, method: str, *args, **kwargs):
        with self._lock:
            self._conn.send((method, args, kwargs))
            return self._answer(method)

    def __getattr__(self, name: str):
        if name == "prefill_budget" and self.__dict__.get("_budget") is not None:
            # vLLM's (tokens, sequences) per step: the precompile's warm-up prefills reach its process by `generate`
            return lambda: self._budget
        if name in METHODS:
            return lambda *a, **kw: self._call(name, *a, **kw)
        raise AttributeError(name)

    def load_weights(self, named_tensors) -> float:
        """Send (name, tensor) pairs (on the trainer's device) to the engine, which loads them; its seconds
        loading. The layout goes over the pipe, the tensors over the weight group (module docstring)."""
        chunks = _chunks(named_tensors)
        layout = [[(name, tuple(t.shape), t.dtype) for name, t in chunk] for chunk in chunks]
        with self._lock:
            self._conn.send(("load_weights", (layout,), {}))
            for work in [self._group.send([t], 1, 0) for chunk in chunks for _, t in chunk]:
                work.wait()
            return self._answer("load_weights")

    def close(self) -> None:
        """Stop the engine's process (it closes its engine first)."""
        atexit.unregister(self.close)
        if not self._proc.is_alive():
            return
        try:
            self._call("close")
        except (RemoteEngineError, OSError, BrokenPipeError):
            pass
        if "_group" in self.__dict__:
            _shut(self._group)
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.terminate()
