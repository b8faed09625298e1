"""spirl_kernels.gemm_cublas's choice between cuBLAS and spirl_kernels.gemm, on CPU with stand-ins for both kernels (the bits
themselves are tests/gpu/test_gemm_cublas_gpu.py's)."""

from __future__ import annotations

import logging

import pytest
import torch

from spirl_kernels import gemm, gemm_cublas


@pytest.fixture
def route(monkeypatch):
    """gemm_cublas with fresh records, enabled on CPU tensors; `calls` counts each stand-in's runs and
    `cublas_off` holds row counts where the cuBLAS stand-in's output differs from the Triton one's."""
    for record in ("_checked", "_enabled", "_generators", "_timings"):
        monkeypatch.setattr(gemm_cublas, record, {})
    state = {"calls": {"cublas": 0, "triton": 0}, "cublas_off": set(), "capturing": False, "timed": [],
             "us": lambda m: (100.0, 120.0)}

    def triton(x, w, config=None):
        state["calls"]["triton"] += 1
        return x.reshape(-1, x.shape[-1]).float().mm(w.float().t()).to(x.dtype).reshape(*x.shape[:-1], w.shape[0])

    def cublas(a, w):
        state["calls"]["cublas"] += 1
        out = a.float().mm(w.float().t()).to(a.dtype)
        if a.shape[0] in state["cublas_off"]:
            out[0, 0] += 1
        return out

    monkeypatch.setattr(gemm, "matmul", triton)
    monkeypatch.setattr(gemm_cublas, "_cublas", cublas)
    monkeypatch.setattr(gemm_cublas, "_capturing", lambda: state["capturing"])
    monkeypatch.setattr(gemm_cublas, "enabled", lambda device: True)

    def time_both(probe, w):
        state["timed"].append(probe.shape[0])
        return state["us"](probe.shape[0])

    monkeypatch.setattr(gemm_cublas, "_time_both", time_both)
    return state


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_each_product_is_checked_once_then_runs_cublas(route):
    w = bf16(64, 32)
    for seed in range(3):
        x = bf16(100, 32, seed=seed)
        assert torch.equal(gemm_cublas.matmul(x, w), gemm.matmul(x, w))
    # the check ran both once (probe), then each of the 3 calls ran cuBLAS; the comparisons above ran Triton
    assert route["calls"]["cublas"] == 1 + 3
    assert gemm_cublas.checked() == {"cublas": 1, "other_bits": 0, "triton_faster": 0}


def test_other_bits_fall_back_to_triton_and_are_logged_once(route, caplog):
    route["cublas_off"].add(72)
    w = bf16(64, 32)
    with caplog.at_level(logging.WARNING, logger="spirl_kernels.gemm_cublas"):
        for seed in range(3):
            x = bf16(72, 32, seed=seed)
            assert torch.equal(gemm_cublas.matmul(x, w), gemm.matmul(x, w))
    assert route["calls"]["cublas"] == 1  # the check's probe only
    assert gemm_cublas.checked() == {"cublas": 0, "other_bits": 1, "triton_faster": 0}
    assert [r.getMessage() for r in caplog.records if "other bits" in r.getMessage()] == [
        ("spirl_kernels.gemm_cublas: cuBLAS gave other bits than the batch-invariant kernel for [72 x 32] @ [32 x 64]; "
         "that product runs spirl_kernels.gemm (same bits as vLLM's, slower)")]
    assert gemm_cublas.use_cublas(bf16(100, 32), w)  # another row count is its own product


def test_capture_runs_triton_until_the_product_was_checked_eagerly(route):
    w, x = bf16(64, 32), bf16(100, 32)
    route["capturing"] = True
    assert not gemm_cublas.use_cublas(x, w)
    assert route["calls"]["cublas"] == 0 and gemm_cublas.checked() == {"cublas": 0, "other_bits": 0, "triton_faster": 0}
    route["capturing"] = False
    assert gemm_cublas.use_cublas(x, w)  # the eager warm-up checks it
    route["capturing"] = True
    assert gemm_cublas.use_cublas(x, w)  # and the capture then records cuBLAS


def test_lm_head_rows_layouts_and_dtypes_stay_on_triton(route):
    head = bf16(70000, 32)
    assert gemm_cublas.use_cublas(bf16(65, 32), head)
    assert gemm_cublas.use_cublas(bf16(512, 32), head)
    assert not gemm_cublas.use_cublas(bf16(513, 32), head)  # vLLM's sampler warm-up size: no check in the profile
    assert route["timed"] == []  # 65-512 rows: cuBLAS once its bits are checked, untimed
    assert gemm_cublas.use_cublas(bf16(gemm_cublas.MAX_ROWS, 32), bf16(64, 32))
    assert not gemm_cublas.use_cublas(bf16(gemm_cublas.MAX_ROWS + 1, 32), bf16(64, 32))
    w = bf16(64, 32)
    assert not gemm_cublas.use_cublas(bf16(100, 64)[:, :32], w)  # rows strided: a layout not checked
    assert not gemm_cublas.use_cublas(bf16(100, 32).float(), w.float())
    x3 = bf16(4, 25, 32)
    assert torch.equal(gemm_cublas.matmul(x3, w), gemm.matmul(x3, w))  # [..., K] inputs flattened to rows
    assert gemm_cublas.matmul(bf16(0, 32), w).shape == (0, 64)


def test_lm_head_at_1_to_64_rows_runs_the_faster_on_this_gpu(route, caplog):
    head = bf16(70000, 32)
    route["us"] = lambda m: (150.0, 140.0) if m == 8 else (140.0, 150.0)  # spirl_kernels.gemm faster at 8 rows only
    with caplog.at_level(logging.INFO, logger="spirl_kernels.gemm_cublas"):
        assert gemm_cublas.use_cublas(bf16(1, 32), head)
        assert not gemm_cublas.use_cublas(bf16(8, 32), head)
        assert gemm_cublas.use_cublas(bf16(64, 32), head)
        for m in (1, 8, 64):  # decided once per row count
            gemm_cublas.use_cublas(bf16(m, 32, seed=1), head)
    assert route["timed"] == [1, 8, 64]
    assert gemm_cublas.checked() == {"cublas": 2, "other_bits": 0, "triton_faster": 1}
    assert [r.getMessage() for r in caplog.records if "takes" in r.getMessage()][1] == (
        "spirl_kernels.gemm_cublas: [8 x 32] @ [32 x 70000] takes 150.0 us on cuBLAS, 140.0 on spirl_kernels.gemm: spirl_kernels.gemm")
    x = bf16(8, 32, seed=2)
    calls = dict(route["calls"])
    assert torch.equal(gemm_cublas.matmul(x, head), gemm.matmul(x, head))
    assert route["calls"]["cublas"] == calls["cublas"]  # 8 rows: the Triton kernel
    route["cublas_off"].add(16)
    assert not gemm_cublas.use_cublas(bf16(16, 32), head)
    assert route["timed"] == [1, 8, 64]  # other bits: not timed
    assert gemm_cublas.use_cublas(bf16(8, 32), bf16(64, 32))  # a narrow output: not timed, cuBLAS
    assert route["timed"] == [1, 8, 64]


def test_timed_and_kept_rules():
    assert [m for m in (1, 64, 65, 512, 513, 2049) if gemm_cublas.timed(m, 151936, 2048)] == [1, 64]
    assert [m for m in (1, 64, 65, 512, 513, 2049) if gemm_cublas.keep_triton(m, 151936, 2048)] == [513, 2049]
    assert not gemm_cublas.timed(1, 12288, 2048) and not gemm_cublas.keep_triton(2048, 12288, 2048)
    assert gemm_cublas.keep_triton(2049, 12288, 2048)
    assert not any(gemm_cublas.timed(m, 151936, 2048) and gemm_cublas.keep_triton(m, 151936, 2048)
                   for m in range(1, 3000))  # a timed product is never one kept on Triton


def test_a_zero_weight_proves_nothing_and_is_checked_again(route):
    x = bf16(100, 32)
    assert not gemm_cublas.use_cublas(x, torch.zeros(64, 32, dtype=torch.bfloat16))
    assert gemm_cublas.checked() == {"cublas": 0, "other_bits": 0, "triton_faster": 0}
    assert gemm_cublas.use_cublas(x, bf16(64, 32))  # the loaded weight: checked now


def test_the_probe_draws_from_its_own_generator(route):
    torch.manual_seed(5)
    before = torch.get_rng_state()
    gemm_cublas.use_cublas(bf16(100, 32), bf16(64, 32))
    assert torch.equal(torch.get_rng_state(), before)


def test_enabled_only_on_hopper_and_not_when_switched_off(monkeypatch):
    monkeypatch.setattr(gemm_cublas, "_enabled", {})
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: cap["value"])
    cuda0 = torch.device("cuda", 0)
    assert not gemm_cublas.enabled(torch.device("cpu"))
    assert gemm_cublas.enabled(cuda0)
    monkeypatch.setattr(gemm_cublas, "_enabled", {})
    cap["value"] = (8, 0)
    assert not gemm_cublas.enabled(cuda0)
    monkeypatch.setattr(gemm_cublas, "_enabled", {})
    cap["value"] = (9, 0)
    monkeypatch.setenv("SPIRL_GEMM_CUBLAS", "0")
    assert not gemm_cublas.enabled(cuda0)


def test_every_graphed_step_may_run_cublas():
    """MAX_ROWS reaches the engine's largest default CUDA-graph step, so every graphed decode and prefill step's
    GEMMs may run on cuBLAS."""
    from spirl.engines.vllm_engine import GRAPH_MAX_TOKENS

    assert gemm_cublas.MAX_ROWS >= GRAPH_MAX_TOKENS
