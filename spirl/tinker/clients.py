"""Tinker's clients (`tinker==0.38.0`) on SPIRL's core: ServiceClient, TrainingClient, SamplingClient, RestClient.

They subclass the SDK's classes (so `isinstance` checks in user code hold) without the SDK's
network session, take and return the SDK's own `tinker.types`, and return the SDK's own futures
(`AwaitableConcurrentFuture`: `.result()`, `await`, `.result_async()`); every `_async` twin is
there, with the SDK's return conventions and deprecation warnings. Client creators return what the
SDK's return: `BackcompatTrainingClientFuture` / `BackcompatSamplingClientFuture`, one object that
is a future of the client and (deprecated, with the SDK's FutureWarning) the client itself, so the
classic style `tc = service.create_lora_training_client(...); tc.forward_backward(...)` runs.
Every public member of the SDK's classes is implemented or refused in one line
(spirl/tinker/surface.py; the tables `REFUSED_*` below and in rest.py). The work runs in
spirl/tinker/backend.py. SPIRL additions: `ServiceClient.create_full_training_client` (full
fine-tuning; Tinker trains LoRA only).

Checkpoint paths are Tinker's, `tinker://<run>/weights/<name>` (save_state: the policy, AdamW and
RNG states; bit-exact load_state) and `tinker://<run>/sampler_weights/<name>` (a PEFT adapter for
LoRA, a Hugging Face checkpoint for full fine-tuning), kept on disk under SPIRL_TINKER_DIR.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import shutil
import uuid
from pathlib import Path

import numpy as np
import tinker
import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from tinker.lib.public_interfaces.backcompat_sampling_client_future import BackcompatSamplingClientFuture
from tinker.lib.public_interfaces.backcompat_training_client_future import BackcompatTrainingClientFuture
from tinker.lib.public_interfaces.custom_loss import LossHandle, trace_loss

from ..engines.base import Request
from . import losses, process, rest
from .backend import TRAIN_TARGETS, BackendConfig, Session
from .surface import done_future, forward_future, forward_sync, sdk_surface

log = logging.getLogger("spirl.tinker")

class APIError(ValueError):
    """A call this backend cannot serve; one line saying why (ValueError, as the cookbook expects)."""


def _training_future(fut: AwaitableConcurrentFuture) -> BackcompatTrainingClientFuture:
    """What the SDK's training-client creators return: a future that is also (deprecated) the client."""
    return BackcompatTrainingClientFuture(fut)


def _on_worker(session: Session, fn, *args) -> AwaitableConcurrentFuture:
    return AwaitableConcurrentFuture(session.submit(fn, *args))


def _tinker_path(run: str, kind: str, name: str) -> str:
    if "/" in name or not name:
        raise APIError(f"checkpoint name {name!r}: use a non-empty name without '/'")
    return f"tinker://{run}/{kind}/{name}"


def local_path(path: str, root: str | None = None) -> Path:
    """tinker://<run>/<kind>/<name> -> <SPIRL_TINKER_DIR>/<run>/<kind>/<name> (a local directory is itself)."""
    if not path.startswith("tinker://"):
        return Path(path)
    types.ParsedCheckpointTinkerPath.from_tinker_path(path)  # the SDK's check of the form: run/kind/name
    run, kind, name = path.removeprefix("tinker://").split("/")
    return Path(root or BackendConfig.from_env().root) / run / kind / name


def _checkpoint(base_model: str):
    """The base model's checkpoint (torchtitan_compat.config.ModelDir), read and checked once per
    process: the session's if one serves `base_model` (a one-line refusal if it serves another), else
    resolved (a Hub id downloaded, `random:<shape>` written) and checked here, for the session to take."""
    from torchtitan_compat.config import ModelDir

    from ..core.preflight import resolve_model, validate_model_dir

    session = process.current()
    if session is not None:
        if base_model not in (session.base_model, str(session.model_dir)):
            raise APIError(f"this process serves base model {session.base_model!r}; SPIRL's local Tinker backend holds "
                           f"one base model per process, not also {base_model!r}")
        return session.checkpoint
    path = resolve_model(base_model, str(Path(BackendConfig.from_env().root) / "models"))
    return ModelDir(path, *validate_model_dir(path))


def _session(base_model: str, checkpoint, lora, seed: int | None) -> Session:
    """The process's session, created by the first client (later ones must use the same base model:
    `_checkpoint` refused any other)."""
    session = process.current()
    if session is not None:
        return session
    cfg = BackendConfig.from_env()
    rest.sweep_expired(Path(cfg.root))
    return process.install(Session(cfg, base_model, checkpoint, lora, 0 if seed is None else seed).start())


def _lora_init(base_model: str, rank: int, targets):
    """(the base model's checkpoint, the LoRAInit of a LoRA client on it): rank, Tinker's alpha,
    `targets` (any order) in model order. The arguments are checked before the model is resolved."""
    from ..core.lora import LoRAInit
    from torchtitan_compat.lora import DEFAULT_ALPHA, TARGETS, LoRASpec, check_spec

    if rank < 1:
        raise APIError(f"rank must be >= 1 for a LoRA training client (got {rank}); "
                       "for full fine-tuning use create_full_training_client")
    if not targets:
        raise APIError("train_mlp, train_attn and train_unembed are all False: nothing to train")
    checkpoint = _checkpoint(base_model)
    spec = LoRASpec(rank, DEFAULT_ALPHA, tuple(t for t in TARGETS if t in targets))
    check_spec(spec, checkpoint.args)
    return checkpoint, LoRAInit(spec)


# -- ServiceClient ------------------------------------------------------------------------------------------------

REFUSED_SERVICE = {
    "get_console_url": "there is no web console for a local run (logs: <SPIRL_TINKER_DIR>/<run>/)",
    "copy_weights": "copies between projects of the hosted service; the local store has no projects",
    "holder": "the SDK's network session holder; SPIRL's local backend has no network session",
}


def _check_optimizer(optimizer) -> None:
    if optimizer is not None and getattr(optimizer, "type", "adamw") != "adamw":
        raise APIError(f"optimizer {optimizer.type!r}: SPIRL trains with AdamW only (Tinker does not publish the "
                       "Dimuon update rule); pass optimizer=None or types.AdamOptimizerConfig()")


@sdk_surface(tinker.ServiceClient, REFUSED_SERVICE)
class ServiceClient(tinker.ServiceClient):
    """Creates training and sampling clients on this machine. Arguments the hosted service reads
    (base_url, api_key, project_id, user_metadata, ...) are accepted and ignored."""

    def __init__(self, *args, user_metadata=None, **kwargs):  # noqa: D107 - no network session to set up
        self.session_id = f"session-{uuid.uuid4().hex[:8]}"
        self._user_metadata = dict(user_metadata or {})

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close("success" if exc_type is None else "errored").result()

    def close(self, status="success", detail=None):
        process.close()
        return done_future(None)

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        return process.server_capabilities()

    async def get_server_capabilities_async(self):
        return process.server_capabilities()

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata=None, optimizer=None):
        """LoRA (alpha 32) on the modules the switches name: attention (q, k, v, o), MLP (gate, up,
        down), unembed (lm_head: with tied embeddings it gets its own output weight, the input
        embedding stays frozen)."""
        _check_optimizer(optimizer)
        checkpoint, lora = _lora_init(base_model, rank, _switch_targets(train_attn, train_mlp, train_unembed))
        session = self._attach(base_model, checkpoint, lora, seed, user_metadata)
        return _training_future(done_future(TrainingClient(session, user_metadata)))

    create_lora_training_client_async = forward_sync("create_lora_training_client_async")

    def create_full_training_client(self, base_model: str, seed: int | None = None, user_metadata=None):
        """SPIRL's addition: full fine-tuning (fp32 masters, AdamW on every weight)."""
        session = self._attach(base_model, _checkpoint(base_model), None, seed, user_metadata)
        return _training_future(done_future(TrainingClient(session, user_metadata)))

    def create_training_client_from_state(self, path: str, base_model=None, user_metadata=None,
                                          weights_access_token=None, optimizer=None):
        _check_optimizer(optimizer)
        return _training_future(self._from_state(path, False, base_model, user_metadata))

    def create_training_client_from_state_with_optimizer(self, path: str, base_model=None, user_metadata=None,
                                                         weights_access_token=None):
        return _training_future(self._from_state(path, True, base_model, user_metadata))

    create_training_client_from_state_async = forward_sync("create_training_client_from_state_async")
    create_training_client_from_state_with_optimizer_async = forward_sync(
        "create_training_client_from_state_with_optimizer_async")

    def _from_state(self, path: str, with_optimizer: bool, base_model, user_metadata):
        state = _read_state(local_path(path))
        if base_model is not None and base_model not in (state["base_model"], state.get("model_dir")):
            raise APIError(f"{path} was trained from {state['base_model']!r}, not {base_model!r}")
        checkpoint, lora = _checkpoint_and_lora(state)
        metadata = user_metadata or state.get("user_metadata")
        client = TrainingClient(self._attach(state["base_model"], checkpoint, lora, state.get("seed"), metadata),
                                metadata)

        def load() -> TrainingClient:
            client._load_state(path, with_optimizer)
            return client
        return client._submit(load)

    def _attach(self, base_model: str, checkpoint, lora, seed, user_metadata):
        session = _attach(base_model, checkpoint, lora, seed)
        meta = {**_session_state(session), "user_metadata": dict(user_metadata or {}), "session_id": self.session_id}
        rest.record_run(Path(session.cfg.root), session.run_id, meta)
        rest.record_session(Path(session.cfg.root), self.session_id, run_id=session.run_id,
                            user_metadata=self._user_metadata)
        return session

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config=None, record_stability_info: bool = False):
        """A sampler of saved sampler weights (`model_path`) or of the base model. Every sampled
        sequence is recorded (its `sequence_id` is on the response) whether or not
        `record_stability_info` is set: that record is what the parity check reads."""
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client needs model_path or base_model")
        if model_path is not None:
            meta = _read_json(local_path(model_path) / "sampler.json", model_path)
            checkpoint, lora = _checkpoint_and_lora(meta)
            session = _session(meta["base_model"], checkpoint, lora, meta.get("seed"))
            fut = _on_worker(session, SamplingClient.from_path, session, model_path)
        else:
            if process.current() is not None:  # the same base model as the session's, or a one-line refusal
                session = _session(base_model, _checkpoint(base_model), None, None)
            else:  # no training client yet: the backend is built as Tinker's default LoRA client would need it
                session = _session(base_model, *_lora_init(base_model, 32, _switch_targets()), None)
            fut = _on_worker(session, SamplingClient.of_base, session)
        fut.future().add_done_callback(lambda f: f.exception() or rest.record_session(
            Path(session.cfg.root), self.session_id, sampler_id=f.result().sampler_id))
        return SamplingClientFuture(fut)

    create_sampling_client_async = forward_sync("create_sampling_client_async")

    def create_rest_client(self):
        return rest.RestClient()

    def create_custom_loss(self, fn, input_ranks):
        """The SDK's own tracing and checks (`tinker...custom_loss.trace_loss`), then a `LossHandle`
        of this session. `forward_backward_custom(data, handle)` runs the traced per-datum loss
        inside the training forward (one forward, micro-batched like the built-in losses), with
        the parity check as for any loss."""
        return done_future(trace_loss(fn, input_ranks, self.session_id))

    def get_telemetry(self):
        return None


def _checkpoint_and_lora(meta: dict):
    """(checkpoint, LoRAInit or None) of what a saved state or sampler's metadata records."""
    lora = meta.get("lora")
    if lora:
        return _lora_init(meta["base_model"], lora["rank"], lora["targets"])
    return _checkpoint(meta["base_model"]), None


def _switch_targets(train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> list[str]:
    """The LoRA targets create_lora_training_client's switches name (their defaults: all of them)."""
    on = {"train_attn": train_attn, "train_mlp": train_mlp, "train_unembed": train_unembed}
    return [t for k, targets in TRAIN_TARGETS.items() if on[k] for t in targets]


def _attach(base_model: str, checkpoint, lora, seed):
    session = _session(base_model, checkpoint, lora, seed)
    mine = getattr(session.lora, "spec", None)
    wanted = getattr(lora, "spec", None)
    if mine != wanted:
        raise APIError(f"this process's backend was built for {_describe(mine)}; it cannot also train {_describe(wanted)}"
                       " (one policy per process: create the training client first, or use another process)")
    if session.trainer_attached:
        raise APIError("this process already has a training client (SPIRL's local backend trains one model per "
                       "process)")
    session.trainer_attached = True
    session.run_id = f"run-{uuid.uuid4().hex[:8]}"
    return session


def _describe(spec) -> str:
    return "full fine-tuning" if spec is None else f"LoRA rank {spec.rank} on {','.join(spec.targets)}"


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise APIError(f"{what}: no readable checkpoint at {path.parent} ({type(e).__name__})") from None


def _read_state(directory: Path) -> dict:
    return _read_json(directory / "state.json", str(directory))


# -- TrainingClient -----------------------------------------------------------------------------------------------

_EXTERNAL = ("external weights are the hosted service's encrypted download exports; locally, "
             "save_weights_for_sampler writes the adapter (or HF checkpoint) as files under SPIRL_TINKER_DIR")
REFUSED_TRAINING = {
    "get_console_url": "there is no web console for a local run (logs: <SPIRL_TINKER_DIR>/<run>/)",
    "save_weights_external": _EXTERNAL,
    "save_weights_external_async": _EXTERNAL,
}


@sdk_surface(tinker.TrainingClient, REFUSED_TRAINING)
class TrainingClient(tinker.TrainingClient):
    """forward, forward_backward (the losses of spirl/tinker/losses.py, a custom callable, or a
    `LossHandle`), optim_step (AdamW), save/load of state and sampler weights, and sampling
    clients of its weights."""

    def __init__(self, session: Session, user_metadata=None):  # noqa: D107
        self._s = session
        self.model_id = session.run_id
        self.user_metadata = dict(user_metadata or {})

    def _submit(self, fn, *args) -> AwaitableConcurrentFuture:
        return _on_worker(self._s, fn, *args)

    # training
    def forward(self, data, loss_fn, loss_fn_config=None):
        return self._submit(self._fb, list(data), loss_fn, loss_fn_config, False)

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        return self._submit(self._fb, list(data), loss_fn, loss_fn_config, True)

    def forward_backward_custom(self, data, loss_fn, *, loss_type_input=None):
        """`loss_fn(data, logprobs_list) -> (loss, metrics)` over all datums at once, or a
        `LossHandle` from `ServiceClient.create_custom_loss`, run per datum. Either runs inside the
        one training forward (no separate scoring pass)."""
        data = list(data)
        if isinstance(loss_fn, LossHandle):
            return self._submit(self._fb, data, "custom", None, True, losses.HandleLoss(loss_fn, data))
        return self._submit(self._fb, data, "custom", None, True, loss_fn)

    def _fb(self, data, loss_fn, config, backward, custom=None):
        if custom is None:
            config = losses.check(loss_fn, config)
        lps, total, custom_metrics, (compared, different) = self._s.forward_backward(
            data, loss_fn, config, backward, custom)
        metrics = {**(custom_metrics or {}), "loss:sum": total, "parity/tokens_compared:sum": float(compared),
                   "parity/tokens_different:sum": float(different)}
        return types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics,
                                           loss_fn_outputs=[{"logprobs": types.TensorData.from_torch(lp)} for lp in lps])

    def optim_step(self, optim_params=None, *, adam_params=None):
        adam = adam_params or optim_params or types.AdamParams()
        if not isinstance(adam, types.AdamParams):
            raise APIError(f"optim_step takes tinker.types.AdamParams (SPIRL trains with AdamW; Tinker does not "
                           f"publish the Dimuon update rule), got {type(adam).__name__}")
        return self._submit(lambda: types.OptimStepResponse(metrics=self._s.optim_step(adam)))

    # checkpoints
    def save_state(self, name: str, ttl_seconds=None, overwrite: bool = False, user_metadata=None):
        path = _tinker_path(self._s.run_id, "weights", name)
        return self._submit(self._save_state, path, ttl_seconds, overwrite, user_metadata)

    def _save_state(self, path: str, ttl_seconds, overwrite: bool, user_metadata):
        from ..core import checkpoint as ckpt

        s = self._s
        directory = local_path(path, s.cfg.root)
        _refuse_existing(directory, path, overwrite)
        adapter = None
        if s.lora is not None:
            from ..core.lora import adapter_writer

            adapter = adapter_writer(s.policy, s.policy_spec, "")
        ckpt.write_dir(directory, s.policy.masters, s.policy.optimizer,
                       {"step": s.version, **_session_state(s), "user_metadata": {**self.user_metadata,
                                                                                **(user_metadata or {})}}, adapter)
        if ttl_seconds is not None:
            rest.set_ttl(Path(s.cfg.root), path, ttl_seconds)
        return types.SaveWeightsResponse(path=path)

    def load_state(self, path: str, weights_access_token=None):
        """The weights of a save_state checkpoint, bit for bit (the optimizer state is not loaded)."""
        return self._submit(self._load_state, path, False)

    def load_state_with_optimizer(self, path: str, weights_access_token=None):
        """The weights and the AdamW state of a save_state checkpoint, bit for bit."""
        return self._submit(self._load_state, path, True)

    def _load_state(self, path: str, with_optimizer: bool):
        from ..core import checkpoint as ckpt
        from ..core.policy import resume_into, sync_weights

        s = self._s
        directory = local_path(path, s.cfg.root)
        _read_state(directory)  # a one-line error for a path that holds no state
        s._before_update()
        if with_optimizer:
            resume_into(s.policy, str(directory), s.device)
        else:
            _, masters, _ = ckpt.load(directory, s.device)
            with torch.no_grad():
                for n, p in s.policy.masters.items():
                    p.copy_(masters[n])
            s.policy.push_masters_to_model()
        sync_weights(s.engine, s.policy, s.policy_spec)
        s.new_version()
        return types.LoadWeightsResponse(path=path, model_id=self.model_id)

    def save_weights_for_sampler(self, name: str, ttl_seconds=None, user_metadata=None):
        path = _tinker_path(self._s.run_id, "sampler_weights", name)
        return self._submit(self._save_sampler, path, ttl_seconds, user_metadata)

    def _save_sampler(self, path: str, ttl_seconds=None, user_metadata=None):
        import weights

        s = self._s
        s.activate(s.version)
        out = local_path(path, s.cfg.root)
        with weights.atomic_directory(out) as tmp:
            if s.lora is not None:
                from ..core.lora import adapter_writer

                adapter_writer(s.policy, s.policy_spec, "")(tmp)
            else:
                from weights_vllm_compat import compat_to_hf

                state = {k: v.detach() for k, v in s.model.state_dict().items()}
                weights.save_hf_checkpoint(compat_to_hf(state, s.model.args), s.model_dir, tmp / "hf", dtype=None)
            meta = {**_session_state(s), "version": s.version, "run_id": s.run_id,
                    "user_metadata": {**self.user_metadata, **(user_metadata or {})}}
            (tmp / "sampler.json").write_text(json.dumps(meta, sort_keys=True) + "\n")
        if ttl_seconds is not None:
            rest.set_ttl(Path(s.cfg.root), path, ttl_seconds)
        return types.SaveWeightsForSamplerResponse(path=path)

    # sampling clients
    def save_weights_and_get_sampling_client(self, name=None, retry_config=None, record_stability_info=False,
                                             kind="snapshot"):
        """A sampler of the current weights (`name`, if given, also saves them as sampler weights)."""
        if name is not None:
            self.save_weights_for_sampler(name)
        return SamplingClientFuture(self._submit(lambda: SamplingClient(self._s, self._s.version)))

    def create_sampling_client(self, model_path: str, retry_config=None, record_stability_info=False):
        return SamplingClientFuture(self._submit(SamplingClient.from_path, self._s, model_path))

    def get_tokenizer(self):
        return _tokenizer(self._s)

    def get_info(self) -> types.GetInfoResponse:
        spec = getattr(self._s.lora, "spec", None)
        return types.GetInfoResponse(model_data=types.ModelData(model_name=self._s.base_model, arch="qwen3"),
                                     model_id=self.model_id, is_lora=spec is not None,
                                     lora_rank=spec.rank if spec else None, model_name=self._s.base_model)

    def get_telemetry(self):
        return None

    # the SDK's async twins: these return a future to await again (the SDK's "double await") ...
    forward_async = forward_future("forward_async")
    forward_backward_async = forward_future("forward_backward_async")
    forward_backward_custom_async = forward_future("forward_backward_custom_async")
    optim_step_async = forward_future("optim_step_async")
    save_state_async = forward_future("save_state_async")
    save_weights_for_sampler_async = forward_future("save_weights_for_sampler_async")

    async def load_state_async(self, path: str, weights_access_token=None):
        return self._submit(self._load_state, path, False)

    async def load_state_with_optimizer_async(self, path: str, weights_access_token=None):
        return self._submit(self._load_state, path, True)

    # ... and these the value
    async def get_info_async(self):
        return self.get_info()

    save_weights_and_get_sampling_client_async = forward_sync("save_weights_and_get_sampling_client_async")
    create_sampling_client_async = forward_sync("create_sampling_client_async")


def _refuse_existing(directory: Path, path: str, overwrite: bool) -> None:
    if directory.exists():
        if not overwrite:
            raise APIError(f"{path} exists; pass overwrite=True or use another name")
        shutil.rmtree(directory)


def _session_state(s: Session) -> dict:
    spec = getattr(s.lora, "spec", None)
    return {"base_model": s.base_model, "model_dir": str(s.model_dir), "seed": s.seed,
            "lora": None if spec is None else {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets)}}


def _tokenizer(s: Session):
    if s.tokenizer is None:
        from ..core.preflight import load_checked_tokenizer

        s.tokenizer = load_checked_tokenizer(s.model_dir)
    return s.tokenizer


# -- SamplingClient -----------------------------------------------------------------------------------------------

REFUSED_SAMPLING = {
    "create": "builds a sampler on the SDK's network session holder; use ServiceClient.create_sampling_client or "
              "TrainingClient.save_weights_and_get_sampling_client",
}

_HANDLE_PREFIX = "spirl-sampler:"


@sdk_surface(tinker.SamplingClient, REFUSED_SAMPLING)
class SamplingClient(tinker.SamplingClient):
    """Samples from, and scores with, the weights it was made with. Logprobs are of the model's own
    distribution (no temperature), as forward_backward computes them, bit for bit."""

    def __init__(self, session: Session, version: int, model_path: str | None = None):  # noqa: D107
        self._s, self.version, self.model_path = session, version, model_path
        self.sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        session.pin(self, version)
        process.register_sampler(self.sampler_id, self)

    @classmethod
    def of_base(cls, s: Session) -> "SamplingClient":
        """The base model's weights (LoRA: every B = 0; full fine-tuning: the checkpoint)."""
        key = "base"
        if key not in s.snapshots:
            if s.lora is not None:
                s.snapshots[key] = {n: (torch.zeros_like(p) if ".lora_B." in n else p.detach().clone())
                                    for n, p in s.policy.masters.items()}
            else:
                s.snapshots[key] = _weights_snapshot(s, s.model_dir)
        return cls(s, key)

    @classmethod
    def from_path(cls, s: Session, path: str) -> "SamplingClient":
        """Sampler weights saved by save_weights_for_sampler: this run's current version if they are
        it, else a snapshot of their own."""
        directory = local_path(path, s.cfg.root)
        meta = _read_json(directory / "sampler.json", path)
        if meta.get("run_id") == s.run_id and meta.get("version") == s.version:
            return cls(s, s.version, path)
        key = f"path:{path}"
        if s.lora is not None:
            from torchtitan_compat.peft_adapter import read_adapter

            _, params, _ = read_adapter(directory, s.model.args)
            s.snapshots[key] = {n: t.to(s.device) for n, t in params.items()}
        else:
            s.snapshots[key] = _weights_snapshot(s, directory / "hf")
        return cls(s, key, path)

    def __reduce__(self):
        raise TypeError("SPIRL's SamplingClient lives in its process (its weights are on this GPU); run rollouts "
                        "in-process (rollout_executor=None)")

    def get_sampler_handle(self) -> str:
        """A string naming this sampler; `SamplingClient.from_sampler_handle` in this process gives a
        client of the same weights (another process cannot: the weights are in this one)."""
        return _HANDLE_PREFIX + self.sampler_id

    @staticmethod
    def from_sampler_handle(handle: str, *, api_key: str | None = None) -> "SamplingClient":
        if not handle.startswith(_HANDLE_PREFIX):
            raise APIError(f"{handle[:40]!r}... is not a SPIRL sampler handle (get_sampler_handle of a SPIRL "
                           "SamplingClient in this process)")
        live = process.live_sampler(handle.removeprefix(_HANDLE_PREFIX))
        return SamplingClient(live._s, live.version, live.model_path)

    def on_queue_state_change(self, queue_state, queue_state_reason) -> None:
        """The hosted service calls this when sampling pauses (rate limits, capacity); the local
        backend has no queue, so it is never called. Kept so subclasses that override it work."""

    def sample(self, prompt, num_samples: int, sampling_params, include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0, target_prompt_logprobs=None,
               prompt_alt_tokens_k: int = 0, prompt_logprobs_last_n=None):
        if topk_prompt_logprobs or topk_sample_logprobs or target_prompt_logprobs is not None or prompt_alt_tokens_k:
            raise APIError("top-k and target prompt logprobs are not served by SPIRL's local backend")
        s, p = self._s, sampling_params
        tokens = prompt.to_ints()
        stop = p.stop
        strings = [stop] if isinstance(stop, str) else [x for x in (stop or []) if isinstance(x, str)]
        ids = tuple(x for x in (stop or []) if isinstance(x, int)) if not isinstance(stop, str) else ()
        max_tokens = p.max_tokens if p.max_tokens is not None else s.cfg.max_model_len - len(tokens)
        seed = p.seed if p.seed is not None else s.next_seed(num_samples)
        req = Request(tokens, n=num_samples, max_tokens=max_tokens, temperature=p.temperature, top_k=p.top_k,
                      top_p=p.top_p, seed=seed, stop_token_ids=ids, ignore_eos=stop is not None and len(stop) == 0)
        fut = cf.Future()
        s.request_sample(self.version, req, fut, include_prompt_logprobs)
        out = cf.Future()

        def done(f):
            try:
                group, prompt_lps = f.result()
                seqs = [_sequence(seq_id, smp, strings, s) for seq_id, smp in group]
                last_n = prompt_logprobs_last_n
                if prompt_lps is not None and last_n is not None:
                    prompt_lps = prompt_lps[-last_n:]
                out.set_result(types.SampleResponse(sequences=seqs, _prompt_logprobs_list=prompt_lps))
            except BaseException as e:  # noqa: BLE001
                out.set_exception(e)
        fut.add_done_callback(done)
        return AwaitableConcurrentFuture(out)

    sample_async = forward_sync("sample_async")

    def compute_logprobs(self, prompt, prompt_logprobs_last_n=None):
        def run():
            self._s.activate(self.version)
            lps = self._s.prompt_logprobs([prompt.to_ints()])[0]
            return lps[-prompt_logprobs_last_n:] if prompt_logprobs_last_n else lps
        return _on_worker(self._s, run)

    compute_logprobs_async = forward_sync("compute_logprobs_async")

    def get_tokenizer(self):
        return _tokenizer(self._s)

    def get_base_model(self) -> str:
        return self._s.base_model

    async def get_base_model_async(self) -> str:
        return self._s.base_model

    def get_telemetry(self):
        return None


class SamplingClientFuture(BackcompatSamplingClientFuture):
    """What the SDK's sampling-client creators return (a future that is also, deprecated, the
    client), with the SDK class's static constructors SPIRL's rather than the networked ones."""

    create = SamplingClient.__dict__["create"]
    from_sampler_handle = SamplingClient.__dict__["from_sampler_handle"]


def _weights_snapshot(s: Session, checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """A full fine-tuning snapshot (parameter name -> tensor, in the model's dtype) of a Hugging Face
    checkpoint directory, for a sampler of those weights."""
    from weights_vllm_compat import load_model

    ref = load_model(checkpoint_dir, dtype=next(s.model.parameters()).dtype, backend="reference")
    return {n: p.detach() for n, p in ref.named_parameters()}


def _sequence(seq_id: str, smp, strings: list[str], s: Session) -> types.SampledSequence:
    """A sampled completion as Tinker's SampledSequence; string stops cut it after the token that
    completes the stop string (the engine samples in token ids and does not see strings)."""
    tokens, lps, reason = list(smp.completion_ids), smp.logprobs.float().numpy(), smp.finish_reason or "length"
    tok = _tokenizer(s) if strings else None
    if strings and any(x in tok.decode(tokens) for x in strings):  # then find the token that completes it
        for i in range(len(tokens)):
            text = tok.decode(tokens[:i + 1])
            if any(x in text for x in strings):
                tokens, lps, reason = tokens[:i + 1], lps[:i + 1], "stop"
                rec = s.sampled.get(seq_id)
                if rec is not None:  # what the caller trains on is the cut sequence
                    s.by_tokens.pop(tuple(rec.prompt + rec.tokens), None)
                    rec.tokens, rec.logprobs = tokens, rec.logprobs[:i + 1]
                    s.by_tokens[tuple(rec.prompt + rec.tokens)] = rec
                break
    return types.SampledSequence(stop_reason="stop" if reason == "stop" else "length", sequence_id=seq_id,
                                 tokens_np=np.asarray(tokens, dtype=np.int32), logprobs_np=np.asarray(lps, np.float32))


RestClient = rest.RestClient
