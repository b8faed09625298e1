"""The `vllm` kernel backend: the very kernels vLLM 0.26.0 runs for Qwen3 in batch-invariant mode.

Which kernel vLLM runs for each op (read from its source, measured on an H100; see
docs/vllm-0.26-forward-path.md):
    linear (every projection and lm_head)  spirl_kernels.gemm.matmul          (Triton; vLLM's linear_batch_invariant
                                            bit for bit, tiles tuned by row count; vllm_patches
                                            makes the engine run it too)
    RMSNorm, incl. q/k norm per head       rms_norm_batch_invariant     (Triton; no residual path,
                                            see vllm_patches.py for why the residual add is separate)
    SiLU-and-mul                           torch.ops._C.silu_and_mul    (CUDA)
    rotary (neox, in place)                torch.ops._C.rotary_embedding (CUDA)
    q/k RMSNorm + rotary (Qwen3)           spirl_kernels.qk_norm_rope (Triton; the two ops above in one
                                            pass, bit for bit; the trainer's only, vLLM runs two)
    attention                              FlashAttention 3 varlen, num_splits=1
    MoE routing (Qwen3-MoE)                torch.ops._moe_C.topk_softmax (CUDA; vLLM's fused_topk)
    MoE experts                            fused_moe_kernel (Triton; vLLM's tuned tiles, the pinned batch-invariant
                                            config's bits: moe_config) for the gate/up and down GEMMs,
                                            _C.silu_and_mul, _moe_C.moe_sum: vLLM's fused_experts unrolled to keep
                                            the gate/up output for the backward
    sampled-token logprob                  vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs
                                            (Triton; NOT torch.log_softmax, which differs by ~1e-6)
    temperature, min-p (processed logprobs) vllm.v1.worker.gpu.sample.gumbel.apply_temperature,
                                            ...sample.min_p.apply_min_p (Triton, in place, as the
                                            V2 sampler applies them before its logprob kernel)
Embedding lookup is F.embedding in both (no op here).
"""

from __future__ import annotations

import torch

from .backend_base import BackendError, batch_invariant_env_enabled, norm_then_rotary

PINNED_VLLM_VERSION = "0.26.0"
SAMPLERS = ("v1", "v2")
BATCH_INVARIANT_MOE_CONFIG = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8,
                              "SPLIT_K": 1}
"""The one fused-MoE Triton config vLLM 0.26.0 uses for every token count in batch-invariant mode
(`fused_moe.get_default_config`). Pinned here so that the trainer computes it even in a process without
batch-invariant mode (the `--allow-batch-variant` comparison); tests/gpu/test_moe_ops.py checks it is vLLM's."""


def moe_config(tokens: int, experts: int, inter: int) -> dict:
    """The fused-MoE Triton config for a call on `tokens` tokens: vLLM's tuned config for this GPU and expert shape
    (`tuned_moe_configs`; the nearest token count, as `try_get_optimal_moe_config` picks it), else the pinned one.
    Every tile gives the pinned config's bits: the kernel's K loop accumulates its MMA steps in order into one
    fp32 accumulator whatever the tile and BLOCK_K (tests/gpu/test_moe_ops.py checks each tuned config against the
    pinned one; compare/bench_moe_config.py times them). The engine picks the same (spirl/numerics/vllm_patches.py,
    patch 5)."""
    table = tuned_moe_configs(experts, inter)
    if not table:
        return dict(BATCH_INVARIANT_MOE_CONFIG)
    return dict(table[min(table, key=lambda m: abs(m - tokens))])


_TUNED: dict[tuple[int, int], dict[int, dict]] = {}


def tuned_moe_configs(experts: int, inter: int) -> dict[int, dict]:
    """{token count: config} from the tuned file vLLM 0.26.0 ships for this GPU, `experts` experts of width `inter`,
    unquantized (`configs/E=..,N=..,device_name=...json`: what plain vLLM reads; in batch-invariant mode vLLM reads
    none); {} where it ships none. A user's VLLM_TUNED_CONFIG_FOLDER is not read: its tiles are not checked."""
    if (experts, inter) not in _TUNED:
        import json
        import os

        import vllm.model_executor.layers.fused_moe.fused_moe as fm

        path = os.path.join(os.path.dirname(os.path.realpath(fm.__file__)), "configs",
                            fm.get_config_file_name(experts, inter, None))
        table = {}
        if os.path.exists(path):
            with open(path) as f:
                table = {int(m): cfg for m, cfg in json.load(f).items()}
        _TUNED[(experts, inter)] = table
    return _TUNED[(experts, inter)]


def vllm_runner(model_args) -> str:
    """The model runner vLLM 0.26.0 gives a model by default (`VllmConfig.use_v2_model_runner`): V2 for dense Qwen3,
    V1 for Qwen3-MoE (a mixture of experts not in its V2 list; V1 is also the one that returns routed experts)."""
    from .config import is_moe

    return "v1" if is_moe(model_args) else "v2"


def _v1_sampling_logits(logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
    if min_p > 0.0:
        raise BackendError("min-p with vLLM's V1 sampler (Qwen3-MoE) is not reproduced by the trainer; use --min-p 0")
    z = logits.float()
    if temperature != 1.0:
        z = z / torch.full((1, 1), temperature, dtype=torch.float32, device=z.device)
    return z


class VLLMBackend:
    name = "vllm"

    def __init__(self, require_batch_invariant: bool = True, sampler: str = "v2"):
        """`sampler`: the vLLM model runner whose sampler computes the engine's logprobs (`vllm_runner`)."""
        if require_batch_invariant and not batch_invariant_env_enabled():
            raise BackendError("the vllm kernel backend needs VLLM_BATCH_INVARIANT=1 in the "
                               "environment before vllm is imported (run: VLLM_BATCH_INVARIANT=1 ...)")
        import vllm

        if vllm.__version__ != PINNED_VLLM_VERSION:
            raise BackendError(f"vLLM {vllm.__version__} is installed but parity is only proven for "
                               f"{PINNED_VLLM_VERSION}: pip install vllm=={PINNED_VLLM_VERSION}")
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C.*)
        from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
        from vllm.v1.worker.gpu.sample.min_p import apply_min_p
        from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        from spirl_kernels.gemm import matmul
        from spirl_kernels.qk_norm_rope import fusable, norm_rope_qk

        if sampler not in SAMPLERS:
            raise BackendError(f"unknown vLLM sampler {sampler!r}; choose one of {SAMPLERS}")
        self.sampler = sampler
        if sampler == "v1":
            from vllm.model_executor.layers.batch_invariant import log_softmax

            self._log_softmax = log_softmax
        self._linear = matmul
        self._qk_fusable, self._norm_rope_qk = fusable, norm_rope_qk
        self._rms_norm = rms_norm_batch_invariant
        self._token_logprobs = compute_token_logprobs
        self._flash_attn = flash_attn_varlen_func
        self._apply_temperature = apply_temperature
        self._apply_min_p = apply_min_p

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        torch.ops._C.silu_and_mul(out, x)
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._linear(x, weight)

    def rope_cache(self, head_dim: int, max_positions: int, theta: float, dtype, device):
        """Built like vLLM's RotaryEmbedding._compute_cos_sin_cache: float32 on the model's device
        (GPU and CPU transcendental functions round differently), then cast to the model dtype."""
        with torch.device(device):
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            t = torch.arange(max_positions, dtype=torch.float)
            freqs = torch.einsum("i,j -> ij", t, inv_freq)
            return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)

    def rotary(self, positions, q, k, cos_sin_cache):
        """In place on q [T, Hq, D] and k [T, Hk, D] (contiguous); returns them."""
        t, d = q.shape[0], q.shape[-1]
        torch.ops._C.rotary_embedding(positions, q.view(t, -1), k.view(t, -1), d, cos_sin_cache, True)
        return q, k

    def qk_norm_rope(self, positions, q, k, q_weight, k_weight, eps: float, cos_sin_cache):
        """The two ops above in one Triton launch for q and k, reading them in place (no copies)."""
        if self._qk_fusable(q, q_weight, cos_sin_cache) and self._qk_fusable(k, k_weight, cos_sin_cache):
            return self._norm_rope_qk(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)
        return norm_then_rotary(self, positions, q, k, q_weight, k_weight, eps, cos_sin_cache)

    def attention(self, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
        """FA3 reads any token/head strides with a unit last stride (v is a slice of the qkv
        output): the values, hence the bits, are those of a contiguous copy."""
        out, lse = self._flash_attn(
            q, k, v, max_seqlen_q=max_seqlen, cu_seqlens_q=cu_seqlens,
            max_seqlen_k=max_seqlen, cu_seqlens_k=cu_seqlens, softmax_scale=scale, causal=True,
            num_splits=1, fa_version=3, return_softmax_lse=True)
        return out, lse

    def moe_route(self, z: torch.Tensor, top_k: int, renormalize: bool):
        """vLLM's fused_topk over bf16 router logits: (w float32 [T, k], ids int32 [T, k])."""
        fused_topk = _moe_module("router.fused_topk_router").fused_topk
        w, ids, _ = fused_topk(z, z, top_k, renormalize)
        return w, ids

    def moe_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                    config: dict | None = None):
        """(y [T, D], c1 [T*k, 2I]): vLLM's `fused_experts` as its Triton experts run it in batch-invariant mode
        (its Triton experts, unrolled to return the gate/up output), with `moe_config`'s tile for T tokens or
        `config` (compare/bench_moe_config.py times tiles and checks their bits)."""
        from vllm.triton_utils import tl

        fm = _moe_module("fused_moe")
        t, k = ids.shape
        e, n2, d = w13.shape
        cfg = dict(config or moe_config(t, e, w2.shape[2]))  # the kernel pops keys from it
        sorted_ids, expert_ids, padded = fm._prepare_expert_assignment(ids, cfg, t, k, e, None,
                                                                       ignore_invalid_experts=True)
        c1 = torch.empty((t, k, n2), dtype=x.dtype, device=x.device)
        c3 = torch.empty((t, k, d), dtype=x.dtype, device=x.device)
        flags = dict(compute_type=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16, use_fp8_w8a8=False,
                     use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False)
        fm.invoke_fused_moe_triton_kernel(x, w13, c1, None, None, None, sorted_ids, expert_ids, padded, False, k,
                                          cfg, **flags)
        c2 = self.silu_and_mul(c1.view(t * k, n2))
        fm.invoke_fused_moe_triton_kernel(c2, w2, c3, None, None, w, sorted_ids, expert_ids, padded, True, 1,
                                          cfg, **flags)
        y = torch.empty_like(x)
        torch.ops._moe_C.moe_sum(c3, y, None, None)
        return y, c1.view(t * k, n2)

    def token_logprobs(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.sampler == "v1":  # V1's Sampler.compute_logprobs: log_softmax(dtype=float32), which batch-invariant
            # mode sends to this Triton kernel
            return self._log_softmax(logits.float(), -1).gather(-1, ids.view(-1, 1))[:, 0]
        return self._token_logprobs(logits, ids.view(-1, 1))[:, 0]

    def sampling_logits(self, logits: torch.Tensor, temperature: float, min_p: float) -> torch.Tensor:
        """vLLM's own in-place temperature and min-p kernels, on a copy (every row reads request 0
        of a one-request parameter table). V1's sampler: float32 logits divided by a float32 temperature
        tensor (`Sampler.apply_temperature`, a true division, not torch's multiply by a scalar's reciprocal)."""
        if self.sampler == "v1":
            return _v1_sampling_logits(logits, temperature, min_p)
        if temperature == 1.0 and min_p == 0.0:
            return logits
        z = logits.clone()
        rows = torch.zeros(z.shape[0], dtype=torch.int32, device=z.device)
        if temperature != 1.0:
            self._apply_temperature(z, rows, torch.tensor([temperature], dtype=torch.float32, device=z.device))
        if min_p > 0.0:
            self._apply_min_p(z, rows, torch.tensor([min_p], dtype=torch.float32, device=z.device))
        return z


def _moe_module(name: str):
    """vllm.model_executor.layers.fused_moe.<name>, after loading vLLM's fused-MoE extension (_moe_C)."""
    import importlib

    try:
        import vllm._moe_C_stable_libtorch  # noqa: F401  (registers torch.ops._moe_C.*)
    except ImportError as e:
        raise BackendError(f"vLLM's fused-MoE extension (vllm._moe_C) does not load ({e}); Qwen3-MoE needs the "
                           "complete vLLM 0.26.0 wheel") from None
    return importlib.import_module(f"vllm.model_executor.layers.fused_moe.{name}")
