"""spirl_kernels/gemm_ws.py on the CPU: every warp-specialized config compiles for sm_90 (the H100) with the installed
Triton, fits an SM's shared memory, and is the kernel its docstring describes: TMA loads and wgmma, no per-thread
cp.async copies. Compiling needs no GPU; whether its outputs are vLLM's bits is tests/gpu/test_gemm.py's
(every config against vLLM's kernel, bit for bit)."""

from __future__ import annotations

import pytest

from spirl_kernels import gemm, gemm_ws

WS_CONFIGS = [c for c in gemm.CONFIGS if c.startswith("ws_")]
SWAPPED_CONFIGS = [c for c in gemm.CONFIGS if c.startswith("wsx_")]


def _qwen3_8b_linear(name: str) -> tuple[int, int]:
    """(N, K) of one of Qwen3-8B's linears by name (weights_vllm_compat.linear_shapes)."""
    import weights_vllm_compat
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

    return weights_vllm_compat.linear_shapes(model_args_from_hf_config(hf_config_for_shape("Qwen3-8B")))[name]


def test_there_are_warp_specialized_configs_and_they_are_picked():
    n, k = _qwen3_8b_linear("down")
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


def test_row_pieces_load_every_row_in_one_or_two_power_of_two_boxes():
    for rows in range(1, 257):
        p1, p2 = gemm_ws.row_pieces(rows)
        assert p1 in (8, 16, 32, 64, 128, 256) and p2 in (0, 8, 16, 32, 64, 128), (rows, p1, p2)
        assert p1 + p2 >= rows and p2 <= p1, (rows, p1, p2)
        assert p1 <= max(rows, 8) and (p2 == 0 or p2 < 2 * (rows - p1) or p2 == 8), (rows, p1, p2)  # no larger
        if rows % 8 == 0 and bin(rows).count("1") <= 2:
            assert p1 + p2 == rows, (rows, p1, p2)  # 72 = 64 + 8, 136 = 128 + 8: not one row out of bounds


def test_tail_pieces_fit_the_last_row_tile():
    for block_m in (64, 128):
        for m in range(1, 1025):
            p1, p2 = gemm_ws.tail_pieces(m, block_m)
            assert (p1, p2) == ((0, 0) if m % block_m == 0 else gemm_ws.row_pieces(m % block_m)), m
            assert p1 + p2 <= block_m, (m, block_m, p1, p2)


@pytest.mark.parametrize("config,rows,boxes", [("ws_m64_n128_s8", 256, 0), ("ws_m64_n128_s8", 136, 1),
                                               ("ws_m64_n128_s8", 216, 2), ("ws_m128_n256_s4", 200, 2)])
def test_a_row_tail_compiles_to_predicated_tma_loads_of_its_rows(config, rows, boxes):
    """216 rows in 64-row tiles leave 24 (16 + 8), 200 in 128-row tiles 72 (64 + 8): one more TMA load per box."""
    bm, bn, group_m, warps, stages = gemm.CONFIGS[config]
    full = gemm_ws.compile_sm90(bm, bn, group_m, warps, stages).asm["ptx"]
    tailed = gemm_ws.compile_sm90(bm, bn, group_m, warps, stages, rows).asm["ptx"]
    assert tailed.count("cp.async.bulk.tensor") == full.count("cp.async.bulk.tensor") + boxes


def test_swapped_token_parts_cover_every_row_count_in_powers_of_two():
    for rows in range(1, gemm.CONFIGS["wsx_n256_s4"][0] + 1):
        t1, t2 = gemm_ws.token_parts(rows)
        assert t1 + t2 >= rows and t1 in (16, 32, 64, 128) and t2 in (8, 16, 32, 64), (rows, t1, t2)
        assert rows <= t1 or t1 == 128, (rows, t1)  # the first part is as large as it can be before a second
        assert rows - t1 <= t2 < 2 * max(rows - t1, 8), (rows, t1, t2)  # the second no larger than it must be


def test_swapped_tiles_are_picked_for_wide_outputs_at_129_to_192_rows():
    n, k = _qwen3_8b_linear("gate_up")
    assert [gemm.pick_config(m, n, k) for m in (128, 129, 160, 192, 193)] == [
        "pers_m128_n256", "wsx_n256_s4", "wsx_n256_s4", "wsx_n256_s4", "pers_m128_n128"]  # 193-320 rows: as timed on an H100, 2026-11-27


@pytest.mark.parametrize("config", SWAPPED_CONFIGS)
@pytest.mark.parametrize("rows", [136, 152, 160, 192])
def test_swapped_compiles_for_sm90_with_tma_and_wgmma(config, rows):
    _, block_w, _, warps, stages = gemm.CONFIGS[config]
    kernel = gemm_ws.compile_swapped_sm90(block_w, rows, warps, stages)
    ptx = kernel.asm["ptx"]
    assert kernel.metadata.shared <= gemm_ws._SMEM_PER_SM - 1024, (config, rows, kernel.metadata.shared)
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert "cp.async.cg" not in ptx and "cp.async.ca" not in ptx
