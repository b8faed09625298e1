"""The one place where SPIRL changes vLLM's behaviour. `apply()` runs once, before an engine exists.

Patch 1 - residual add + RMSNorm (vLLM 0.26.0, `VLLM_BATCH_INVARIANT=1`):
    Why: vLLM's `RMSNorm.forward_cuda` calls `rms_norm_batch_invariant(x, w, eps, residual)`. With a
    residual (every norm after the first one of the model) that function does not use the
    batch-invariant Triton kernel: it calls the CUDA op `fused_add_rms_norm`, whose thread-block
    size (and so its float32 reduction order) depends on how many tokens the whole engine step
    holds (< 256 or not). The same sequence then gets logits 1 bf16 ulp apart depending on what
    else is batched with it, and decode-time logprobs differ from prefill-time ones (measured: 25
    to 113 of 512 sampled tokens; docs/vllm-0.26-forward-path.md section 3).
    What: `residual = bf16(x + residual)` (the exact value the fused op writes), then the Triton
    batch-invariant RMSNorm of the new residual, as one kernel (`spirl_kernels.add_rms_norm`: the same
    add, rounding and reduction, bitwise the two-kernel path; one launch and one pass fewer per
    norm, which counts at decode sizes); other layouts take the two kernels. The trainer
    (`torchtitan_compat/model.py`) computes the residual stream the same way, so both sides run
    the same arithmetic.

Patch 2 - the batch-invariant linear layers' GEMM (vLLM 0.26.0, `VLLM_BATCH_INVARIANT=1`):
    Why: vLLM's unquantized linear layers and lm_head call `linear_batch_invariant`, one Triton
    config (128x128 tiles) for every row count. At decode (one row per sequence) that launches as
    few as 16 programs for a 2048-wide output on a 132-SM GPU: the decode step is several times
    slower than cuBLAS. `spirl_kernels.gemm.matmul` keeps vLLM's reduction order exactly (BLOCK_K 64,
    the same K loop, fp32 accumulator, one rounding), so its output is bitwise vLLM's for every
    row, and picks its tile shape by the row count for speed (tests/gpu/test_gemm.py proves the
    bits). The trainer's linear layers run the same kernel. On Hopper the engine runs cuBLAS instead
    wherever cuBLAS, set up without split-K as vLLM's batch-invariant mode sets it up there, is checked
    to give that kernel's bits for the product (`spirl_kernels.gemm_cublas`: up to 1.7x faster at a decode
    step's 65-512 rows; each (M, N, K) checked on its first eager call, and lm_head at 1-64 rows also timed
    against that kernel there, since which is faster depends on the GPU).
    What: the name `linear_batch_invariant` in vLLM's `linear` and `vocab_parallel_embedding`
    modules (where `UnquantizedLinearMethod.apply` and `UnquantizedEmbeddingMethod.apply` look it
    up) is rebound to a function of the same signature that calls `spirl_kernels.gemm_cublas.matmul` on the weight's plain
    tensor (`.data`: vLLM's parameter classes define a Python `__torch_function__`, which each of the shape,
    stride and pointer reads of an eager launch would go through; lm_head runs eagerly every decode step).

Patch 3 - Qwen3's q/k RMSNorm + rotary in the engine (vLLM 0.26.0, `VLLM_BATCH_INVARIANT=1`):
    Why: `Qwen3Attention.forward` normalizes q and k per head (`q_norm`/`k_norm`: a contiguous copy of
    each strided slice of the qkv output, then the Triton `_rms_norm_kernel`) and rotates them in place
    (`rotary_embedding`): six kernels per layer. Profiled at Qwen3-8B, 128 prompts x 2048 tokens
    (H100), they took 7.5 % of the prefill's GPU time (docs/rollout-engine.md). The trainer already
    runs them as one pass, `spirl_kernels.qk_norm_rope`, proven bitwise equal to these modules on strided
    qkv slices (tests/gpu/test_ops_vs_vllm.py).
    What: `Qwen3Attention.forward` computes q and k with `spirl_kernels.qk_norm_rope` when the layer's modules
    are the ones that kernel reproduces (`fused_qk`: RMSNorm and neox RotaryEmbedding dispatched to
    their CUDA forwards, full rotary, batch-invariant mode); any other layer runs vLLM's own forward.

Patch 4 - Qwen3's model-class inspection in-process (vLLM 0.26.0; start-up only, no numerics):
    Why: when `VLLM_CACHE_ROOT/modelinfos/` has no entry for the architecture's module (a new
    machine, or a new vLLM), vLLM's registry inspects the model class in a fresh Python subprocess
    (`_run_in_subprocess`, so that the API-server process never initializes CUDA before it forks
    workers). That subprocess imports torch and vLLM again: 16.8 s of a 67.7 s cold
    `run_comparison.sh` on an H100 host (docs/cold-start.md). SPIRL runs the engine in its own
    process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, no fork) and imports the Qwen3 module to build the
    model anyway (patch 3 imports it already).
    What: for the Qwen3 module only, `_LazyRegisteredModel.inspect_model_cls` runs its inspection
    function in this process (vLLM's own function; its cache file is written as before); every
    other architecture keeps the subprocess.

Patch 5 - the fused-MoE experts' Triton tiles (vLLM 0.26.0, `VLLM_BATCH_INVARIANT=1`, Qwen3-MoE):
    Why: in batch-invariant mode `get_moe_configs` returns None before reading vLLM's tuned config file, so
    `fused_moe_kernel` runs one 64 x 64 x 32 tile at every token count. The tile does not decide the bits (the K
    loop accumulates its MMA steps in order into one fp32 accumulator whatever BLOCK_M, BLOCK_N or BLOCK_K:
    every tuned config of the file is checked equal to the pinned one, tests/gpu/test_moe_ops.py), but it decides
    the speed: on an H200 the tuned tiles take 0.85x the pinned one's time at 8 tokens and 0.62x at 4,096
    (compare/bench_moe_config.py).
    What: `get_moe_configs` returns the tuned table vLLM ships for the GPU and shape
    (`torchtitan_compat.vllm_ops.tuned_moe_configs`; the trainer picks from the same table) for unquantized
    experts; quantized experts and shapes without a file keep vLLM's own answer (the pinned tile).
"""

from __future__ import annotations

import contextlib
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
    _patch_qwen3_qk_norm_rope()
    _patch_inprocess_model_inspection()
    _patch_moe_configs()
    _applied = True
    log.info("vLLM patches applied: residual add + batch-invariant Triton RMSNorm; row-count-tuned GEMM (cuBLAS where "
             "checked bitwise equal); Qwen3 q/k norm + rotary in one pass; Qwen3 model class inspected in-process; "
             "fused-MoE experts on vLLM's tuned tiles")


def _patch_residual_rms_norm() -> None:
    import vllm.model_executor.layers.layernorm as layernorm
    from vllm.model_executor.layers.batch_invariant import (
        rms_norm_batch_invariant as triton_rms_norm,
    )

    from spirl_kernels.add_rms_norm import add_rms_norm_, fusable

    def rms_norm_separate_residual_add(input, weight, eps=1e-6, residual=None):
        if residual is None:
            return triton_rms_norm(input, weight, eps)
        if fusable(input, residual, weight):
            return add_rms_norm_(input, residual, weight, eps), residual  # residual updated in place
        residual.add_(input)  # vLLM's layers expect the residual updated in place
        return triton_rms_norm(residual, weight, eps), residual

    layernorm.rms_norm_batch_invariant = rms_norm_separate_residual_add


def _patch_linear_gemm() -> None:
    import torch
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab

    from spirl_kernels.gemm_cublas import matmul

    def linear_batch_invariant_tuned(input, weight, bias=None):
        if type(weight) is not torch.Tensor:  # vLLM's parameter classes run a Python `__torch_function__` on every
            weight = weight.data              # attribute read, and matmul reads a dozen (module doc, patch 2)
        out = matmul(input, weight)
        return out if bias is None else out + bias  # vLLM adds a bias after the GEMM in bf16 too

    linear.linear_batch_invariant = linear_batch_invariant_tuned
    vocab.linear_batch_invariant = linear_batch_invariant_tuned


def _patch_moe_configs() -> None:
    import vllm.model_executor.layers.fused_moe.fused_moe as fm

    from torchtitan_compat.vllm_ops import tuned_moe_configs

    original = fm.get_moe_configs

    def get_moe_configs(E, N, dtype, block_n=None, block_k=None):
        if dtype is None and not (block_n and block_k):  # unquantized: the tiles checked bitwise (module doc)
            return tuned_moe_configs(E, N) or None
        return original(E, N, dtype, block_n, block_k)

    fm.get_moe_configs = get_moe_configs


def _reproducible_qk_modules(attn) -> bool:
    """Whether `spirl_kernels.qk_norm_rope` computes exactly what this Qwen3Attention's q_norm, k_norm and
    rotary_emb compute: vLLM's RMSNorm on its CUDA path in batch-invariant mode (the Triton norm),
    passing its weight, no variance override; vLLM's base RotaryEmbedding on its CUDA kernel (not
    FlashInfer), neox style, rotating the whole head. Checked once per layer (module attributes)."""
    import vllm.envs as envs
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    def runs(module, cls, method) -> bool:
        return type(module) is cls and getattr(module._forward_method, "__func__", None) is method

    norms_ok = all(runs(n, RMSNorm, RMSNorm.forward_cuda) and n.variance_size_override is None and n.pass_weight
                   for n in (attn.q_norm, attn.k_norm))
    norms_ok = norms_ok and attn.q_norm.variance_epsilon == attn.k_norm.variance_epsilon  # one launch, one eps
    rope = attn.rotary_emb
    rope_ok = (runs(rope, RotaryEmbedding, RotaryEmbedding.forward_cuda) and not rope.use_flashinfer
               and rope.is_neox_style and rope.rotary_dim == rope.head_size == attn.head_dim)
    return bool(envs.VLLM_BATCH_INVARIANT) and norms_ok and rope_ok


def _qk_gate(attn) -> bool:
    """_reproducible_qk_modules(attn), computed on the layer's first call and kept on the layer."""
    ok = attn.__dict__.get("_spirl_qk_fusable")
    if ok is None:
        ok = attn.__dict__["_spirl_qk_fusable"] = _reproducible_qk_modules(attn)
    return ok


def fused_qk(attn, positions, q, k):
    """(q, k) of `Qwen3Attention` - per-head RMSNorm then rotary - by `spirl_kernels.qk_norm_rope`, each a new
    contiguous [T, heads * head_dim] tensor; None where the kernel does not reproduce the layer's modules
    (the caller then runs vLLM's forward). q, k: the [T, heads * head_dim] slices of the qkv output."""
    from spirl_kernels.qk_norm_rope import fusable, norm_rope_qk

    if not _qk_gate(attn) or q.dim() != 2 or positions.dim() != 1:
        return None
    t, d = q.shape[0], attn.head_dim
    qh, kh = q.view(t, -1, d), k.view(t, -1, d)
    cache = attn.rotary_emb._match_cos_sin_cache_dtype(q)  # what the rotary module itself passes its kernel
    if not (fusable(qh, attn.q_norm.weight, cache) and fusable(kh, attn.k_norm.weight, cache)):
        return None
    qo, ko = norm_rope_qk(qh, kh, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon, positions,
                          cache)
    return qo.view(t, -1), ko.view(t, -1)


@contextlib.contextmanager
def qk_through_vllms_modules(layers):
    """Within: these Qwen3 layers compute q/k with vLLM's own q_norm, k_norm and rotary_emb modules
    (patch 3 off), so forward hooks on those modules fire (spirl.numerics.localize captures them).
    The values are the same bits either way (tests/gpu/test_ops_vs_vllm.py); only the kernels differ."""
    attns = [layer.self_attn for layer in layers]
    saved = [a.__dict__.get("_spirl_qk_fusable") for a in attns]
    for a in attns:
        a.__dict__["_spirl_qk_fusable"] = False
    try:
        yield
    finally:
        for a, v in zip(attns, saved, strict=True):
            if v is None:
                a.__dict__.pop("_spirl_qk_fusable", None)
            else:
                a.__dict__["_spirl_qk_fusable"] = v


@contextlib.contextmanager
def eager_steps(llm):
    """Within: vLLM's engine steps run eagerly, with no CUDA graph replay, so that forward hooks on its modules
    fire (spirl.numerics.localize captures them; a replayed graph runs its kernels without calling a module).
    The same kernels on the same inputs: the same bits either way (tests/gpu/test_parity.py). vLLM 0.26.0's V2
    model runner replays a graph only while its graph manager says its graphs are captured
    (`CudaGraphManager.dispatch`); that flag is cleared here and restored after."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    manager = getattr(runner, "cudagraph_manager", None)
    captured = getattr(manager, "_graphs_captured", False)
    if captured:
        manager._graphs_captured = False
    try:
        yield
    finally:
        if captured:
            manager._graphs_captured = True


def _patch_qwen3_qk_norm_rope() -> None:
    from vllm.model_executor.models.qwen3 import Qwen3Attention

    vllms_forward = Qwen3Attention.forward

    def forward(self, positions, hidden_states):
        if not _qk_gate(self):
            return vllms_forward(self, positions, hidden_states)
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qk = fused_qk(self, positions, q, k)
        if qk is None:  # a dtype or layout the kernel does not cover (not bf16/fp16): vLLM's forward, from the top
            return vllms_forward(self, positions, hidden_states)
        output, _ = self.o_proj(self.attn(*qk, v))
        return output

    forward.__wrapped__ = vllms_forward  # the original, for tests and for anyone undoing the patch
    Qwen3Attention.forward = forward


INSPECTED_IN_PROCESS = ("vllm.model_executor.models.qwen3",)
"""Modules whose model classes patch 4 inspects in this process: the ones SPIRL imports anyway."""


def _patch_inprocess_model_inspection() -> None:
    from vllm.model_executor.models import registry

    vllms_inspect = registry._LazyRegisteredModel.inspect_model_cls

    def inspect_model_cls(self):
        if self.module_name not in INSPECTED_IN_PROCESS:
            return vllms_inspect(self)
        in_subprocess = registry._run_in_subprocess
        registry._run_in_subprocess = lambda fn: fn()
        try:
            return vllms_inspect(self)  # cache lookup, inspection, cache write: all vLLM's code
        finally:
            registry._run_in_subprocess = in_subprocess

    inspect_model_cls.__wrapped__ = vllms_inspect
    registry._LazyRegisteredModel.inspect_model_cls = inspect_model_cls
