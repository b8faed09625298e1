"""spirl_kernels/launch.py on the GPU: after a kernel's first launch through Triton's JIT, later launches with the same
specialization run the compiled kernel directly; every output stays bitwise what it was (vLLM's, for the GEMM).
Each op is called several times on new tensors (new addresses) of one shape, and once on a view whose address is
not 16-byte aligned, which Triton compiles separately (`launch` keys it apart)."""

from __future__ import annotations

import pytest
import torch

import spirl_kernels.gemm as gemm
from spirl_kernels import launch

# one config per launch branch of spirl_kernels.gemm.matmul: TMA, stream-K, persistent (one-part with and without a row
# tail, two-part), swapped pointer kernel, pointer kernel (masked, vLLM's, deep pipeline), warp-specialized (Gluon,
# not through `launch`)
CONFIGS = ["tma_m128_n128", "sk_m128_n256", "pers_m128_n256", "pers_m128_n128", "p2_m144_n256", "swp_m16_n32",
           "dec_m64_n32_s12", "vllm", "m128_n128_s5", "ws_m64_n128_s8"]


def rand(*shape, seed, scale=0.5):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.parametrize("config", CONFIGS)
def test_repeated_gemm_launches_keep_vllms_bits(config):
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    for n, k in [(4096, 2048), (1000, 1000)]:
        for m in (1, 100, 257, 1000):
            for seed in range(3):  # the first launch through the JIT, the next two direct
                w, x = rand(n, k, seed=seed), rand(m, k, seed=m + seed)
                assert torch.equal(gemm.matmul(x, w, config), linear_batch_invariant(x, w)), (config, m, n, k, seed)
            skewed = rand(m, k + 8, seed=7)[:, 1:k + 1]  # address 2 bytes past alignment, row stride k + 8
            assert torch.equal(gemm.matmul(skewed, w, config), gemm.matmul(skewed.contiguous(), w, config))


def test_the_second_launch_skips_the_jit(monkeypatch):
    kernel = gemm._bi_matmul_persistent_kernel
    jit_calls = []
    run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **kw: jit_calls.append(1) or run(*a, **kw))
    monkeypatch.setattr(launch, "_COMPILED", {})
    w = rand(4096, 2048, seed=1)
    outs = [gemm.matmul(rand(2064, 2048, seed=s), w, "pers_m128_n256") for s in range(3)]
    assert len(jit_calls) == 1 and len(launch._COMPILED) == 1
    assert torch.equal(outs[2], gemm.matmul(rand(2064, 2048, seed=2), w, "pers_m128_n256"))


def test_repeated_norm_launches_keep_their_bits():
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

    from spirl_kernels.add_rms_norm import add_rms_norm_
    from spirl_kernels.qk_norm_rope import norm_rope_qk
    from torchtitan_compat.vllm_ops import VLLMBackend

    for seed in range(3):
        x, res, w = rand(300, 2048, seed=seed, scale=3), rand(300, 2048, seed=seed + 10), rand(2048, seed=seed + 20)
        ref_res = res.clone().add_(x)
        ref = rms_norm_batch_invariant(ref_res, w, 1e-6)
        assert torch.equal(add_rms_norm_(x, res, w, 1e-6), ref) and torch.equal(res, ref_res)
    import vllm._custom_ops  # noqa: F401

    cache = VLLMBackend(require_batch_invariant=False).rope_cache(128, 40960, 1e6, torch.bfloat16, "cuda")
    for seed in range(3):
        t = 77
        q, k = rand(t, 16, 128, seed=seed, scale=3), rand(t, 8, 128, seed=seed + 5, scale=3)
        wq, wk = 1 + rand(128, seed=seed + 6, scale=0.3), 1 + rand(128, seed=seed + 7, scale=0.3)
        pos = torch.randint(0, 40960, (t,), device="cuda")
        vq, vk = rms_norm_batch_invariant(q, wq, 1e-6), rms_norm_batch_invariant(k, wk, 1e-6)
        torch.ops._C.rotary_embedding(pos, vq.view(t, -1), vk.view(t, -1), 128, cache, True)
        oq, ok = norm_rope_qk(q, k, wq, wk, 1e-6, pos, cache)
        assert torch.equal(oq, vq) and torch.equal(ok, vk)
