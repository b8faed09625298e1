"""What the two kernel backends share: the error a backend raises, the VLLM_BATCH_INVARIANT switch, and
Qwen3's q/k step composed from a backend's own ops.

Its own module so that `ops.py` (the reference backend, and `select_backend`, which builds the vLLM one)
and `vllm_ops.py` (the vLLM backend) both import it without importing each other.
"""

from __future__ import annotations

import os


class BackendError(RuntimeError):
    """The requested kernel backend cannot run here."""


def batch_invariant_env_enabled() -> bool:
    return os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")


def norm_then_rotary(backend, positions, q, k, q_weight, k_weight, eps: float, cos_sin_cache):
    """Qwen3's q/k step as two ops of `backend`, the way vLLM runs it: per-head RMSNorm of q and k
    (new tensors), then the rotation of those (a backend may rotate them in place)."""
    return backend.rotary(positions, backend.rms_norm(q, q_weight, eps), backend.rms_norm(k, k_weight, eps),
                          cos_sin_cache)
