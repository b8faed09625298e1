"""kernels/gemm_ws.py on the CPU: every warp-specialized config compiles for sm_90 (the H100) with the installed
Triton, fits an SM's shared memory, and is the kernel its docstring describes: TMA loads and wgmma, no per-thread
cp.async copies. Compiling needs no GPU; whether its outputs are vLLM's bits is tests/gpu/test_gemm.py's
(every config against vLLM's kernel, bit for bit)."""

from __future__ import annotations

import pytest

from kernels import gemm, gemm_ws

WS_CONFIGS = [c for c in gemm.CONFIGS if c.startswith("ws_")]


def test_there_are_warp_specialized_configs_and_they_are_picked():
    from compare.bench_gemm import layer_shapes

    n, k = layer_shapes("Qwen3-8B")["down"]
    assert WS_CONFIGS and gemm.pick_config(160, n, k) in WS_CONFIGS


@pytest.mark.parametrize("config", WS_CONFIGS)
def test_compiles_for_sm90_with_tma_and_wgmma(config):
    bm, bn, group_m, warps, stages = gemm.CONFIGS[config]
    kernel = gemm_ws.compile_sm90(bm, bn, group_m, warps, stages)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= gemm_ws._SMEM_PER_SM - 1024, (config, kernel.metadata.shared)
    assert kernel.metadata.shared >= gemm_ws.smem_bytes(bm, bn, stages)
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert "cp.async.cg" not in ptx and "cp.async.ca" not in ptx  # the loader warp's TMA, not per-thread copies
    # one loader warp beside the MMA warps (rounded up to whole warpgroups)
    assert kernel.metadata.num_warps == -(-(warps + 1) // 4) * 4
