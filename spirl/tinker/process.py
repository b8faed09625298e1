"""What one process of the local Tinker backend holds, shared by the clients (clients.py) and the
RestClient (rest.py): its one session (one base model, its engine and policy: backend.Session) and
its live SamplingClients (by sampler id, for RestClient.get_sampler and sampler handles)."""

from __future__ import annotations

import weakref

from tinker import types

from .backend import BackendConfig, Session

_session: Session | None = None
_samplers: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


class UnknownSampler(ValueError):
    """A sampler id or handle that no live SamplingClient of this process has (one line)."""


def current() -> Session | None:
    return _session


def install(session: Session) -> Session:
    global _session
    _session = session
    return session


def close() -> None:
    """Close the process's backend (the engine first): on `ServiceClient.close`, and on every exit of
    `python -m spirl.tinker`, errors included."""
    global _session
    if _session is not None:
        session, _session = _session, None
        session.close()


def server_capabilities() -> types.GetServerCapabilitiesResponse:
    name = _session.base_model if _session else "a local Qwen3 checkpoint directory or Hub id"
    limit = _session.cfg.max_model_len if _session else BackendConfig.from_env().max_model_len
    return types.GetServerCapabilitiesResponse(supported_models=[types.SupportedModel(
        model_name=name, max_context_length=limit, trainable=True, sampleable=True)])


def register_sampler(sampler_id: str, sampler) -> None:
    _samplers[sampler_id] = sampler


def live_sampler(sampler_id: str):
    s = _samplers.get(sampler_id)
    if s is None:
        raise UnknownSampler(f"no live sampler {sampler_id!r} in this process (SPIRL's samplers hold weights on this "
                             "machine's GPU and live in the process that made them)")
    return s
