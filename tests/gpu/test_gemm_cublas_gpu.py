"""spirl_kernels.gemm_cublas (the engine's GEMM) against vLLM 0.26's batch-invariant GEMM, bit for bit, with cuBLAS set up
as vLLM's batch-invariant mode sets it up.

That set-up (a 1 KiB cuBLASLt workspace: no split-K) is read when the process makes its first cuBLAS handle, so
each case runs in a fresh Python process (this file run as a script) that calls vLLM's
`enable_batch_invariant_mode()` before any GEMM, as the engine's process does.

* `test_engine_gemm_is_vllms_bits`: whatever cuBLAS does, the engine's GEMM gives vLLM's bits (each product is
  checked before cuBLAS is trusted with it) at every Qwen3-1.7B and Qwen3-8B linear shape, rows 1-600 and some
  prefill sizes, and inside a CUDA graph captured before and after a product's check.
* `test_cublas_gives_vllms_bits_on_hopper`: the premise of the speed-up, pinned: on an H100/H200 with the pinned
  torch's cuBLAS, cuBLAS gives vLLM's bits for every one of those products, so none falls back to the slower
  Triton kernel. If a new cuBLAS or GPU breaks that, this fails and names the products; parity still holds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

SHAPES = ("Qwen3-1.7B", "Qwen3-8B")
ROWS = [*range(1, 601), 640, 1000, 1024, 2064, 4096]


def _sweep(shape: str) -> dict:
    from vllm.model_executor.layers.batch_invariant import enable_batch_invariant_mode

    enable_batch_invariant_mode()  # before the first cuBLAS handle, as the engine's process
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    import weights_vllm_compat
    from spirl_kernels import gemm_cublas
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config

    shapes = weights_vllm_compat.linear_shapes(model_args_from_hf_config(hf_config_for_shape(shape)))
    g = torch.Generator(device="cuda").manual_seed(0)
    wrong = []
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            if not torch.equal(gemm_cublas.matmul(x, w), linear_batch_invariant(x, w)):
                wrong.append([name, m])
    other = [[m, n, k] for (m, n, k, _), found in gemm_cublas._checked.items() if found == gemm_cublas.OTHER_BITS]

    # a CUDA graph captured before the product was checked (Triton) and after (cuBLAS): vLLM's bits on replay
    from spirl_kernels import gemm

    n, k = shapes["gate_up"]
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(700, k, generator=g, device="cuda").to(torch.bfloat16)
    ref = linear_batch_invariant(x, w)
    gemm.matmul(x, w)  # the Triton kernel compiled outside capture
    graphs = []
    for phase in ("unchecked", "checked"):
        on_cublas = None
        if phase == "checked":
            on_cublas = gemm_cublas.use_cublas(x, w)  # the eager call's check, as vLLM's warm-up run makes it
            gemm_cublas.matmul(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = gemm_cublas.matmul(x, w)
        checked_after = (700, n, k, x.device) in gemm_cublas._checked
        graph.replay()
        torch.cuda.synchronize()
        graphs.append({"phase": phase, "cublas": on_cublas, "checked_after_capture": checked_after,
                       "equal": torch.equal(y, ref)})
    cublas_products = sum(not gemm_cublas.keep_triton(m, n, k) for n, k in shapes.values() for m in ROWS)
    timings = [[m, n, k, *us] for (m, n, k, _), us in gemm_cublas._timings.items()]
    timed = sum(gemm_cublas.timed(m, n, k) for n, k in shapes.values() for m in ROWS)
    return {"wrong": wrong, "other_bits": other, "checked": gemm_cublas.checked(), "graphs": graphs,
            "cublas_products": cublas_products, "timings": timings, "timed_products": timed}


def _run(shape: str) -> dict:
    out = subprocess.run([sys.executable, __file__, shape], capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sweeps():
    return {shape: _run(shape) for shape in SHAPES}


@pytest.mark.parametrize("shape", SHAPES)
def test_engine_gemm_is_vllms_bits(sweeps, shape):
    got = sweeps[shape]
    assert got["wrong"] == [], f"{shape}: (layer, rows) not vLLM's bits: {got['wrong'][:20]}"
    first, second = got["graphs"]
    assert first["equal"] and second["equal"], got["graphs"]
    assert not first["checked_after_capture"], "a capture must not check a product (it cannot compare on the host)"
    assert second["checked_after_capture"]


@pytest.mark.parametrize("shape", SHAPES)
def test_cublas_gives_vllms_bits_on_hopper(sweeps, shape):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLAS is used (and was measured) on Hopper only")
    got = sweeps[shape]
    assert got["other_bits"] == [], f"{shape}: cuBLAS gave other bits at (M, N, K) {got['other_bits'][:20]}"
    assert got["graphs"][1]["cublas"] is True  # the graph captured after the check recorded cuBLAS
    # every product that may run on cuBLAS (not spirl_kernels.gemm_cublas.keep_triton) was checked and found equal; those
    # `timed` were timed, and run cuBLAS where it was the faster
    found = got["checked"]
    assert found["cublas"] + found["triton_faster"] == got["cublas_products"] + 1  # + the graph case's product
    assert len(got["timings"]) == got["timed_products"] > 0
    assert found["triton_faster"] == sum(cublas_us >= triton_us for *_, cublas_us, triton_us in got["timings"])
    print(f"{shape} lm_head, us a call (rows, cuBLAS, spirl_kernels.gemm):",
          [(m, round(c, 1), round(t, 1)) for m, _, _, c, t in got["timings"]])


def test_timing_measures_gpu_time():
    """`_gpu_us` counts the GPU's time, not the host's: three products a call take about three times one product's
    time (between 2.5x and 3.5x: the products are equal, so only timing noise separates the ratio from 3)."""
    from spirl_kernels import gemm_cublas

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(151936, 2048, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(8, 2048, generator=g, device="cuda").to(torch.bfloat16)
    one = min(gemm_cublas._gpu_us(lambda: torch.mm(x, w.t())) for _ in range(3))
    three = min(gemm_cublas._gpu_us(lambda: [torch.mm(x, w.t()) for _ in range(3)]) for _ in range(3))
    assert 2.5 < three / one < 3.5, (one, three)


if __name__ == "__main__":
    print(json.dumps(_sweep(sys.argv[1])))
