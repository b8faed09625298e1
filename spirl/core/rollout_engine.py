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

Transport: Python's multiprocessing (spawn) pipe, with torch's tensor pickling; the weights travel as host copies
(shared memory), the samples' logprobs and routes come back the same way.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger("spirl.core.rollout_engine")

METHODS = ("generate", "sample", "load_weights", "greedy")
"""The engine calls forwarded to the engine's process."""


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


class RemoteEngineError(RuntimeError):
    """The engine's process failed or died; one line saying which call and why."""


def _visible_gpu(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of visible GPU `index` (the engine's process then sees only that GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


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


def _build(p: EngineProcess):
    """The engine of the engine's process (a native one on its own decoder)."""
    from torchtitan_compat.config import ModelDir

    model = ModelDir.read(p.model_dir)
    decoder = own_decoder(model, torch.device(p.device), p.dtype) if p.engine.kind == "native" else None
    return make_engine(p.engine, model, decoder)


def _serve(conn, p: EngineProcess) -> None:
    """The engine's process: build the engine, then answer calls until `close` (or the trainer goes away)."""
    if p.device.startswith("cuda"):
        os.environ["CUDA_VISIBLE_DEVICES"] = _visible_gpu(torch.device(p.device).index or 0)
        p = EngineProcess(p.engine, p.model_dir, "cuda:0", p.dtype)
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
            break
        try:
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
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()
        self.device = process.device
        # not a daemon: vLLM starts processes of its own (a daemon may not); if the trainer dies, the engine's
        # process reads EOF and ends
        self._proc = ctx.Process(target=_serve, args=(child, process), name="spirl-engine", daemon=False)
        self._proc.start()
        child.close()
        atexit.register(self.close)  # runs before multiprocessing joins its children at exit (atexit is LIFO)
        self._budget = self._answer("starting the engine's process")
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
        """Send (name, tensor) pairs: host copies, whatever device the trainer's tensors are on."""
        return self._call("load_weights", [(k, v.detach().to("cpu", copy=True)) for k, v in named_tensors])

    def close(self) -> None:
        """Stop the engine's process (it closes its engine first)."""
        atexit.unregister(self.close)
        if not self._proc.is_alive():
            return
        try:
            self._call("close")
        except (RemoteEngineError, OSError, BrokenPipeError):
            pass
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.terminate()
