"""The one place where SPIRL changes vLLM's behaviour. `apply()` runs once, before an engine exists.

Patch 1 - residual add + RMSNorm (vLLM 0.26.0, `VLLM_BATCH_INVARIANT=1`):
    Why: vLLM's `RMSNorm.forward_cuda` calls `rms_norm_batch_invariant(x, w, eps, residual)`. With a
    residual (every norm after the first one of the model) that function does not use the
    batch-invariant Triton kernel: it calls the CUDA op `fused_add_rms_norm`, whose thread-block
    size (and so its float32 reduction order) depends on how many tokens the whole engine step
    holds (< 256 or not). The same sequence then gets logits 1 bf16 ulp apart depending on what
    else is batched with it, and decode-time logprobs differ from prefill-time ones (measured: 25
    to 113 of 512 sampled tokens; docs/vllm-0.26-forward-path.md section 3 and
    ../shared/notes/vllm-0.26-on-h100.md).
    What: `residual = bf16(x + residual)` (the exact value the fused op writes), then the Triton
    batch-invariant RMSNorm of the new residual. The trainer (`torchtitan_compat/model.py`)
    computes the residual stream exactly this way, so both sides run the same arithmetic.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_applied = False


def apply() -> None:
    """Install every patch (idempotent). Must run in the process that builds the vLLM model."""
    global _applied
    if _applied:
        return
    _patch_residual_rms_norm()
    _applied = True
    log.info("vLLM patches applied: residual add + batch-invariant Triton RMSNorm")


def _patch_residual_rms_norm() -> None:
    import vllm.model_executor.layers.layernorm as layernorm
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant as triton_rms_norm

    def rms_norm_separate_residual_add(input, weight, eps=1e-6, residual=None):
        if residual is None:
            return triton_rms_norm(input, weight, eps)
        residual.add_(input)  # vLLM's layers expect the residual updated in place
        return triton_rms_norm(residual, weight, eps), residual

    layernorm.rms_norm_batch_invariant = rms_norm_separate_residual_add
