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
    batch-invariant RMSNorm of the new residual, as one kernel (`kernels.add_rms_norm`: the same
    add, rounding and reduction, bitwise the two-kernel path; one launch and one pass fewer per
    norm, which counts at decode sizes); other layouts take the two kernels. The trainer
    (`torchtitan_compat/model.py`) computes the residual stream the same way, so both sides run
    the same arithmetic.

Patch 2 - the batch-invariant linear layers' GEMM (vLLM 0.26.0, `VLLM_BATCH_INVARIANT=1`):
    Why: vLLM's unquantized linear layers and lm_head call `linear_batch_invariant`, one Triton
    config (128x128 tiles) for every row count. At decode (one row per sequence) that launches as
    few as 16 programs for a 2048-wide output on a 132-SM GPU: the decode step is several times
    slower than cuBLAS. `kernels.gemm.matmul` keeps vLLM's reduction order exactly (BLOCK_K 64,
    the same K loop, fp32 accumulator, one rounding), so its output is bitwise vLLM's for every
    row, and picks its tile shape by the row count for speed (tests/gpu/test_gemm.py proves the
    bits). The trainer's linear layers run the same kernel.
    What: the name `linear_batch_invariant` in vLLM's `linear` and `vocab_parallel_embedding`
    modules (where `UnquantizedLinearMethod.apply` and `UnquantizedEmbeddingMethod.apply` look it
    up) is rebound to a function of the same signature that calls `kernels.gemm.matmul`.
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
    _patch_linear_gemm()
    _applied = True
    log.info("vLLM patches applied: residual add + batch-invariant Triton RMSNorm; row-count-tuned GEMM")


def _patch_residual_rms_norm() -> None:
    import vllm.model_executor.layers.layernorm as layernorm
    from vllm.model_executor.layers.batch_invariant import (
        rms_norm_batch_invariant as triton_rms_norm,
    )

    from kernels.add_rms_norm import add_rms_norm_, fusable

    def rms_norm_separate_residual_add(input, weight, eps=1e-6, residual=None):
        if residual is None:
            return triton_rms_norm(input, weight, eps)
        if fusable(input, residual, weight):
            return add_rms_norm_(input, residual, weight, eps), residual  # residual updated in place
        residual.add_(input)  # vLLM's layers expect the residual updated in place
        return triton_rms_norm(residual, weight, eps), residual

    layernorm.rms_norm_batch_invariant = rms_norm_separate_residual_add


def _patch_linear_gemm() -> None:
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab

    from kernels.gemm import matmul

    def linear_batch_invariant_tuned(input, weight, bias=None):
        out = matmul(input, weight)
        return out if bias is None else out + bias  # vLLM adds a bias after the GEMM in bf16 too

    linear.linear_batch_invariant = linear_batch_invariant_tuned
    vocab.linear_batch_invariant = linear_batch_invariant_tuned
