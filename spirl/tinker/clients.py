"""Tinker's clients (`tinker==0.38.0`) on SPIRL's core: ServiceClient, TrainingClient, SamplingClient, RestClient.

They subclass the SDK's classes (so `isinstance` checks in user code hold) without the SDK's
network session, take and return the SDK's own `tinker.types`, and return the SDK's own futures
(`AwaitableConcurrentFuture`: `.result()`, `await`, `.result_async()`); every `_async` twin is
there, with the SDK's return conventions. The work runs in spirl/tinker/backend.py. SPIRL
additions: `ServiceClient.create_full_training_client` (full fine-tuning; Tinker trains LoRA only).

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
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import tinker
import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture

from ..engines.base import Request
from . import losses
from .backend import TRAIN_TARGETS, BackendConfig, Session

log = logging.getLogger("spirl.tinker")

_SESSION: Session | None = None
"""The process's backend: one base model, one engine (see backend.py)."""


class APIError(ValueError):
    """A call this backend cannot serve; one line saying why (ValueError, as the cookbook expects)."""


def _future(value) -> AwaitableConcurrentFuture:
    f = cf.Future()
    f.set_result(value)
    return AwaitableConcurrentFuture(f)


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


def _session(base_model: str, lora, seed: int | None) -> Session:
    """The process's session, created by the first client (later ones must use the same base model)."""
    global _SESSION
    from ..core.preflight import resolve_model

    cfg = BackendConfig.from_env()
    if _SESSION is not None:
        same = base_model in (_SESSION.base_model, str(_SESSION.model_dir))
        if not same:
            raise APIError(f"this process serves base model {_SESSION.base_model!r}; SPIRL's local Tinker backend holds "
                           f"one base model per process, not also {base_model!r}")
        return _SESSION
    model_dir = resolve_model(base_model, str(Path(cfg.root) / "models"))
    _SESSION = Session(cfg, base_model, model_dir, lora, 0 if seed is None else seed).start()
    return _SESSION


def _lora_init(base_model: str, rank: int, targets):
    """The LoRAInit of a LoRA client: rank, Tinker's alpha, `targets` (any order) in model order."""
    from ..core.lora import LoRAInit
    from ..core.preflight import resolve_model, validate_model_dir
    from torchtitan_compat.lora import DEFAULT_ALPHA, TARGETS, LoRASpec, check_spec

    if rank < 1:
        raise APIError(f"rank must be >= 1 for a LoRA training client (got {rank}); "
                       "for full fine-tuning use create_full_training_client")
    if not targets:
        raise APIError("train_mlp, train_attn and train_unembed are all False: nothing to train")
    _, args = validate_model_dir(resolve_model(base_model, str(Path(BackendConfig.from_env().root) / "models")))
    spec = LoRASpec(rank, DEFAULT_ALPHA, tuple(t for t in TARGETS if t in targets))
    check_spec(spec, args)
    return LoRAInit(spec)


# -- ServiceClient ------------------------------------------------------------------------------------------------


class ServiceClient(tinker.ServiceClient):
    """Creates training and sampling clients on this machine. Arguments the hosted service reads
    (base_url, api_key, project_id, user_metadata, ...) are accepted and ignored."""

    def __init__(self, *args, **kwargs):  # noqa: D107 - no network session, nothing to set up
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close("success" if exc_type is None else "errored").result()

    def close(self, status="success", detail=None):
        global _SESSION
        if _SESSION is not None:
            _SESSION.close()
            _SESSION = None
        return _future(None)

    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        name = _SESSION.base_model if _SESSION else "a local Qwen3 checkpoint directory or Hub id"
        limit = _SESSION.cfg.max_model_len if _SESSION else BackendConfig.from_env().max_model_len
        return types.GetServerCapabilitiesResponse(supported_models=[types.SupportedModel(
            model_name=name, max_context_length=limit, trainable=True, sampleable=True)])

    async def get_server_capabilities_async(self):
        return self.get_server_capabilities()

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata=None, optimizer=None):
        """LoRA (alpha 32) on the modules the switches name: attention (q, k, v, o), MLP (gate, up,
        down), unembed (lm_head: with tied embeddings it gets its own output weight, the input
        embedding stays frozen)."""
        lora = _lora_init(base_model, rank, _switch_targets(train_attn, train_mlp, train_unembed))
        return _future(TrainingClient(_attach(base_model, lora, seed), user_metadata))

    async def create_lora_training_client_async(self, *args, **kwargs):
        return self.create_lora_training_client(*args, **kwargs).result()

    def create_full_training_client(self, base_model: str, seed: int | None = None, user_metadata=None):
        """SPIRL's addition: full fine-tuning (fp32 masters, AdamW on every weight)."""
        return _future(TrainingClient(_attach(base_model, None, seed), user_metadata))

    def create_training_client_from_state(self, path: str, base_model=None, user_metadata=None,
                                          weights_access_token=None, optimizer=None):
        return self._from_state(path, False, user_metadata)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model=None, user_metadata=None,
                                                         weights_access_token=None):
        return self._from_state(path, True, user_metadata)

    async def create_training_client_from_state_async(self, *a, **kw):
        return self.create_training_client_from_state(*a, **kw).result()

    async def create_training_client_from_state_with_optimizer_async(self, *a, **kw):
        return self.create_training_client_from_state_with_optimizer(*a, **kw).result()

    def _from_state(self, path: str, with_optimizer: bool, user_metadata):
        state = _read_state(local_path(path))
        lora = None
        if state.get("lora"):
            lora = _lora_init(state["base_model"], state["lora"]["rank"], state["lora"]["targets"])
        client = TrainingClient(_attach(state["base_model"], lora, state.get("seed")), user_metadata or
                                state.get("user_metadata"))
        client.load_state(path, with_optimizer).result()
        return _future(client)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config=None, record_stability_info: bool = False):
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client needs model_path or base_model")
        if model_path is not None:
            meta = _read_json(local_path(model_path) / "sampler.json", model_path)
            lora = meta.get("lora")
            if lora:
                lora = _lora_init(meta["base_model"], lora["rank"], lora["targets"])
            session = _session(meta["base_model"], lora or None, meta.get("seed"))
            return _on_worker(session, SamplingClient.from_path, session, model_path)
        if _SESSION is not None:
            session = _session(base_model, None, None)  # the same base model, or a one-line refusal
        else:  # no training client yet: the backend is built as Tinker's default LoRA client would need it
            session = _session(base_model, _lora_init(base_model, 32, _switch_targets()), None)
        return _on_worker(session, SamplingClient.of_base, session)

    async def create_sampling_client_async(self, *a, **kw):
        return self.create_sampling_client(*a, **kw).result()

    def create_rest_client(self):
        return RestClient()

    def get_telemetry(self):
        return None


def _switch_targets(train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> list[str]:
    """The LoRA targets create_lora_training_client's switches name (their defaults: all of them)."""
    on = {"train_attn": train_attn, "train_mlp": train_mlp, "train_unembed": train_unembed}
    return [t for k, targets in TRAIN_TARGETS.items() if on[k] for t in targets]


def _attach(base_model: str, lora, seed):
    session = _session(base_model, lora, seed)
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


class TrainingClient(tinker.TrainingClient):
    """forward, forward_backward (the losses of spirl/tinker/losses.py, or a custom one), optim_step
    (AdamW), save/load of state and sampler weights, and sampling clients of its weights."""

    def __init__(self, session: Session, user_metadata=None):  # noqa: D107
        self._s = session
        self.model_id = session.run_id
        self.user_metadata = dict(user_metadata or {})

    # training
    def forward(self, data, loss_fn, loss_fn_config=None):
        return _on_worker(self._s, self._fb, list(data), loss_fn, loss_fn_config, False)

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        return _on_worker(self._s, self._fb, list(data), loss_fn, loss_fn_config, True)

    def forward_backward_custom(self, data, loss_fn, *, loss_type_input=None):
        return _on_worker(self._s, self._fb, list(data), "custom", None, True, loss_fn)

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
            raise TypeError(f"optim_step takes tinker.types.AdamParams (SPIRL trains with AdamW), got {type(adam).__name__}")
        return _on_worker(self._s, lambda: types.OptimStepResponse(metrics=self._s.optim_step(adam)))

    # checkpoints
    def save_state(self, name: str, ttl_seconds=None, overwrite: bool = False, user_metadata=None):
        path = _tinker_path(self._s.run_id, "weights", name)
        return _on_worker(self._s, self._save_state, path, user_metadata)

    def _save_state(self, path: str, user_metadata):
        from ..core import checkpoint as ckpt

        s = self._s
        adapter = None
        if s.lora is not None:
            from ..core.lora import adapter_writer

            adapter = adapter_writer(s.policy, s.train_config, "")
        ckpt.write_dir(local_path(path, s.cfg.root), s.policy.masters, s.policy.optimizer,
                       {"step": s.version, **_session_state(s), "user_metadata": {**self.user_metadata,
                                                                                **(user_metadata or {})}}, adapter)
        return types.SaveWeightsResponse(path=path)

    def load_state(self, path: str, with_optimizer: bool = False, weights_access_token=None):
        return _on_worker(self._s, self._load_state, path, with_optimizer)

    def load_state_with_optimizer(self, path: str, weights_access_token=None):
        return self.load_state(path, True)

    def _load_state(self, path: str, with_optimizer: bool):
        from ..core import checkpoint as ckpt
        from ..core.policy import resume_into, sync_weights

        s = self._s
        directory = local_path(path, s.cfg.root)
        s._before_update()
        if with_optimizer:
            resume_into(s.policy, str(directory), s.device)
        else:
            _, masters, _ = ckpt.load(directory, s.device)
            with torch.no_grad():
                for n, p in s.policy.masters.items():
                    p.copy_(masters[n])
            s.policy.push_masters_to_model()
        sync_weights(s.engine, s.policy, s.train_config)
        s.new_version()
        return types.LoadWeightsResponse(path=path, model_id=self.model_id)

    def save_weights_for_sampler(self, name: str, ttl_seconds=None, user_metadata=None):
        path = _tinker_path(self._s.run_id, "sampler_weights", name)
        return _on_worker(self._s, self._save_sampler, path)

    def _save_sampler(self, path: str):
        import weights

        s = self._s
        s.activate(s.version)
        out = local_path(path, s.cfg.root)
        with weights.atomic_directory(out) as tmp:
            if s.lora is not None:
                from ..core.lora import adapter_writer

                adapter_writer(s.policy, s.train_config, "")(tmp)
            else:
                from weights_vllm_compat import compat_to_hf

                state = {k: v.detach() for k, v in s.model.state_dict().items()}
                weights.save_hf_checkpoint(compat_to_hf(state, s.model.args), s.model_dir, tmp / "hf", dtype=None)
            (tmp / "sampler.json").write_text(json.dumps({**_session_state(s), "version": s.version,
                                                          "run_id": s.run_id}) + "\n")
        return types.SaveWeightsForSamplerResponse(path=path)

    # sampling clients
    def save_weights_and_get_sampling_client(self, name=None, retry_config=None, record_stability_info=False,
                                             kind="snapshot"):
        return _on_worker(self._s, lambda: SamplingClient(self._s, self._s.version))

    def create_sampling_client(self, model_path: str, retry_config=None, record_stability_info=False):
        return _on_worker(self._s, SamplingClient.from_path, self._s, model_path)

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
    async def forward_async(self, *a, **kw):
        return self.forward(*a, **kw)

    async def forward_backward_async(self, *a, **kw):
        return self.forward_backward(*a, **kw)

    async def forward_backward_custom_async(self, *a, **kw):
        return self.forward_backward_custom(*a, **kw)

    async def optim_step_async(self, *a, **kw):
        return self.optim_step(*a, **kw)

    async def save_state_async(self, *a, **kw):
        return self.save_state(*a, **kw)

    async def save_weights_for_sampler_async(self, *a, **kw):
        return self.save_weights_for_sampler(*a, **kw)

    # ... and these the value
    async def get_info_async(self):
        return self.get_info()

    async def save_weights_and_get_sampling_client_async(self, *a, **kw):
        return await self.save_weights_and_get_sampling_client(*a, **kw)

    async def create_sampling_client_async(self, *a, **kw):
        return await self.create_sampling_client(*a, **kw)


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


class SamplingClient(tinker.SamplingClient):
    """Samples from, and scores with, the weights it was made with. Logprobs are of the model's own
    distribution (no temperature), as forward_backward computes them, bit for bit."""

    def __init__(self, session: Session, version: int):  # noqa: D107
        self._s, self.version = session, version
        session.pin(self, version)

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
            return cls(s, s.version)
        key = f"path:{path}"
        if s.lora is not None:
            from torchtitan_compat.peft_adapter import read_adapter

            _, params, _ = read_adapter(directory, s.model.args)
            s.snapshots[key] = {n: t.to(s.device) for n, t in params.items()}
        else:
            s.snapshots[key] = _weights_snapshot(s, directory / "hf")
        return cls(s, key)

    def __reduce__(self):
        raise TypeError("SPIRL's SamplingClient lives in its process (its weights are on this GPU); run rollouts "
                        "in-process (rollout_executor=None)")

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
        req = Request(tokens, n=num_samples, max_tokens=max_tokens, temperature=p.temperature, top_k=p.top_k,
                      top_p=p.top_p, seed=p.seed if p.seed is not None else s.next_seed(), stop_token_ids=ids,
                      ignore_eos=stop is not None and len(stop) == 0)
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

    async def sample_async(self, *a, **kw):
        return await self.sample(*a, **kw)

    def compute_logprobs(self, prompt, prompt_logprobs_last_n=None):
        def run():
            self._s.activate(self.version)
            lps = self._s.prompt_logprobs([prompt.to_ints()])[0]
            return lps[-prompt_logprobs_last_n:] if prompt_logprobs_last_n else lps
        return _on_worker(self._s, run)

    async def compute_logprobs_async(self, *a, **kw):
        return await self.compute_logprobs(*a, **kw)

    def get_tokenizer(self):
        return _tokenizer(self._s)

    def get_base_model(self) -> str:
        return self._s.base_model

    async def get_base_model_async(self) -> str:
        return self._s.base_model

    def get_telemetry(self):
        return None


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


# -- RestClient ---------------------------------------------------------------------------------------------------


class RestClient(tinker.RestClient):
    """What tinker-cookbook asks of the REST client: a training run by checkpoint path, deleting one."""

    def __init__(self, *args, **kwargs):  # noqa: D107
        pass

    def get_training_run_by_tinker_path(self, tinker_path: str, access_scope="owned"):
        directory = local_path(tinker_path)
        meta_file = next((directory / f for f in ("state.json", "sampler.json") if (directory / f).is_file()), None)
        if meta_file is None:
            raise ValueError(f"no checkpoint at {tinker_path} ({directory})")
        meta = json.loads(meta_file.read_text())
        lora = meta.get("lora") or {}
        return _future(types.TrainingRun(
            training_run_id=types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path).training_run_id,
            base_model=meta["base_model"], model_owner="local", is_lora=bool(lora), lora_rank=lora.get("rank"),
            last_request_time=datetime.now(timezone.utc), user_metadata=meta.get("user_metadata") or {}))

    def delete_checkpoint_from_tinker_path(self, tinker_path: str):
        shutil.rmtree(local_path(tinker_path), ignore_errors=True)
        return _future(None)

    def get_telemetry(self):
        return None
