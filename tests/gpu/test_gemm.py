"""spirl_kernels.gemm.matmul against vLLM 0.26's own batch-invariant GEMM, bit for bit.

Every tile config in `spirl_kernels.gemm.CONFIGS` (the row-count-tuned ones the engine and trainer pick,
and two that are never picked) must give exactly vLLM's `linear_batch_invariant` output, at the
Qwen3-1.7B linear shapes and row counts from decode (1) to training (4096), including row counts
that are not multiples of any tile. This is what lets the engine (patched to call this kernel)
and the trainer (forward and, in row chunks, lm_head) agree bitwise with vLLM's kernel.
"""

from __future__ import annotations

import pytest
import torch

from spirl_kernels.gemm import CONFIGS, matmul

# Qwen3-1.7B: qkv, o, gate_up, down projections (N, K), and one odd shape; lm_head is checked separately
SHAPES = [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144),
          (1000, 1000)]  # N and K not multiples of any tile: masked and TMA zero-filled tails
ROWS = [1, 7, 33, 100, 256, 511, 1000, 4096]


def rand(*shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * 0.5).to(torch.bfloat16)


@pytest.fixture(scope="module")
def vllm_linear():
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant

    return linear_batch_invariant


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_config_is_vllms_gemm_bitwise(vllm_linear, n, k, config):
    w = rand(n, k, seed=1)
    for m in ROWS:
        x = rand(m, k, seed=m)
        assert torch.equal(matmul(x, w, config), vllm_linear(x, w)), (m, n, k, config)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.startswith(("ws_", "wsx_"))])
def test_warp_specialized_row_tails_are_vllms_bits(vllm_linear, config):
    """Decode-step row counts whose last row tile is part-filled (8, 16, 24, 40, ... rows past the last full
    tile, and two not multiples of 8): that tile loads only a box of its first rows and the rest of its shared
    memory holds stale values (spirl_kernels/gemm_ws.py, "Row tails"); the rows stored are still vLLM's bits."""
    for n, k in [(4096, 2048), (2048, 6144)]:
        w = rand(n, k, seed=11)
        for m in (130, 136, 144, 152, 168, 200, 264, 330, 456):
            x = rand(m, k, seed=m)
            assert torch.equal(matmul(x, w, config), vllm_linear(x, w)), (m, n, k, config)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.startswith("pers_m128_")])
def test_persistent_row_tails_are_vllms_bits(vllm_linear, config):
    """Row counts that leave 1-64 rows in the last 128-row tile: the persistent kernel computes that tile from a
    16-64-row box with the operands swapped (`persistent_tail`), and spreads its tiles over a program count that
    shares no factor with the row tiles (`persistent_programs`: more tiles than SMs at 12288 and 24576 wide); every
    stored row is still vLLM's bits, and the rows of a full tile and of the tail agree with a call on them alone."""
    from spirl_kernels.gemm import persistent_tail

    for n, k in [(12288, 2048), (24576, 1024), (1000, 1000)]:
        w = rand(n, k, seed=12)
        for m in (129, 136, 160, 192, 257, 272, 288, 300, 320, 2064, 2100):
            x = rand(m, k, seed=m)
            y = matmul(x, w, config)
            assert torch.equal(y, vllm_linear(x, w)), (m, n, k, config, persistent_tail(m, 128, CONFIGS[config][1]))
        assert torch.equal(matmul(x[-36:], w, config), y[-36:])


def test_lm_head_rows_alone_equal_rows_in_a_batch(vllm_linear):
    """A row's logits do not depend on how many rows share the call (the lm_head chunking)."""
    w = rand(151936, 2048, seed=2)
    x = rand(700, 2048, seed=3)
    full = matmul(x, w)
    assert torch.equal(full, vllm_linear(x, w))
    for lo, hi in [(0, 1), (5, 37), (100, 612), (612, 700)]:
        assert torch.equal(matmul(x[lo:hi], w), full[lo:hi])


def test_stream_k_launches_back_to_back_and_in_a_cuda_graph(vllm_linear):
    """The stream-K kernel's flags are left at zero by each launch (the consumer resets them), so launch after
    launch, eager and replayed from a CUDA graph (as vLLM's decode runs it), every output is vLLM's bits. At
    Qwen3-8B's down projection, 136 rows, 64x64 tiles make 192 tiles: more than one SM's share each, so tiles
    are cut between programs."""
    w = rand(4096, 12288, seed=4)
    x = rand(136, 12288, seed=5)
    ref = vllm_linear(x, w)
    outs = [matmul(x, w, "sk_m64_n64") for _ in range(50)]
    assert all(torch.equal(y, ref) for y in outs)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        matmul(x, w, "sk_m64_n64")  # warm-up outside capture, as vLLM's capture does
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = matmul(x, w, "sk_m64_n64")
    for _ in range(20):
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ref)
