"""The Tinker API (`tinker==0.38.0`: sample / forward_backward / optim_step) on SPIRL's core, with
sampler-trainer parity bit for bit.

    python -m spirl.tinker SCRIPT.py [ARGS...]      # runs an unmodified Tinker script on this machine

`clients.py`: the SDK's Service/Training/Sampling clients on this backend; `rest.py`: the RestClient
over the local store (runs, checkpoints, TTLs, sessions); `process.py`: the process's one session
and its live samplers, which both read; `surface.py`: every public SDK member
implemented or refused in one line, checked by introspection; `backend.py`: the session (one base
model, its engine and policy, one worker thread, weights versions, the parity check); `losses.py`:
the loss functions as Tinker documents them, and custom losses by handle; `__main__.py`: the
launcher. See README.md, "Tinker API".
"""

from .clients import RestClient, SamplingClient, ServiceClient, TrainingClient

__all__ = ["RestClient", "SamplingClient", "ServiceClient", "TrainingClient"]
