"""spirl_kernels/gemm.py on CPU: every tile config's indexing (tails, masks, TMA boxes, the persistent kernel's
tile walk) in Triton's interpreter, and `pick_config`'s names.

The interpreter computes each `tl.dot` with NumPy, so equality here says nothing about GPU bits (those are
proven against vLLM's kernel by tests/gpu/test_gemm.py); it does catch a config that reads or writes the
wrong elements, which on the GPU would show up only as a failed parity run.
"""

from __future__ import annotations

import pytest

from spirl_kernels.gemm import CONFIGS, pick_config

_INTERPRETED = r"""
import torch
import spirl_kernels.gemm as gemm
from tests import interpreter_bf16_dot

interpreter_bf16_dot.patch()  # else the interpreter's bf16 tl.dot multiplies bit patterns (that module's doc)
gemm._num_sms = lambda device: 3   # a CPU has no SMs; 3 programs make the persistent kernel walk many tiles
torch.manual_seed(0)
bad = []
for m, n, k in [(1, 96, 200), (20, 40, 72), (130, 264, 136)]:   # no dimension a multiple of every tile
    # small integers: every product and partial sum is exact in float32, so each config's output must be the
    # exact product rounded once to bf16, whatever order NumPy adds a tile's products in
    x = torch.randint(-3, 4, (m, k)).to(torch.bfloat16)
    w = torch.randint(-3, 4, (n, k)).to(torch.bfloat16)
    ref = (x.double() @ w.double().T).to(torch.bfloat16)
    bad += [(m, n, k, c) for c in gemm.CONFIGS if not torch.equal(gemm.matmul(x, w, c), ref)]
    # a stream-K config first called inside CUDA-graph capture (no flags yet) runs the pointer kernel's tiles
    real_flags, gemm._streamk_flags = gemm._streamk_flags, lambda device: None
    bad += [(m, n, k, c, "no flags") for c in gemm.CONFIGS if c.startswith("sk_")
            and not torch.equal(gemm.matmul(x, w, c), ref)]
    gemm._streamk_flags = real_flags
print(bad or "ok")
"""


def test_every_config_writes_the_exact_product_in_triton_s_interpreter(triton_interpreter):
    """Every config (the warp-specialized ones through their pointer-kernel fallback: the interpreter has no TMA
    unit for Gluon) reads the right elements of x and w and writes every element of y once."""
    assert triton_interpreter("-c", _INTERPRETED, timeout=600).strip() == "ok"


def test_pick_config_names_a_config_for_every_shape():
    shapes = [(n, k) for n in (1, 1000, 2048, 4096, 6144, 12288, 24576, 151936) for k in (64, 2048, 12288)]
    for m in (1, 8, 64, 65, 128, 129, 256, 257, 512, 513, 1023, 1024, 2047, 2048, 16384):
        for n, k in shapes:
            assert pick_config(m, n, k) in CONFIGS, (m, n, k)


def _decode_step_picks():
    """(shape, layer, N, K, rows, pick) for every real Qwen3 linear at every decode step of 65-512 rows: the
    CUDA-graph capture sizes vLLM 0.26 uses on an H100 (`compare.rollout_sweep.capture_sizes`), which a
    decode step's GEMMs always run at."""
    import weights_vllm_compat
    from compare.rollout_sweep import capture_sizes
    from torchtitan_compat.config import SHAPES, hf_config_for_shape, model_args_from_hf_config

    rows = [m for m in capture_sizes() if m > 64]
    for shape in (s for s in SHAPES if s.startswith("Qwen3")):
        args = model_args_from_hf_config(hf_config_for_shape(shape))
        for layer, (n, k) in weights_vllm_compat.linear_shapes(args).items():
            for m in rows:
                yield shape, layer, n, k, m, pick_config(m, n, k)


def test_decode_steps_of_65_to_512_rows_take_masked_or_tma_tiles():
    """A decode step runs the GEMMs at a CUDA-graph capture size (multiples of 8 to 256, then of 16). At the
    sizes that are not multiples of 16 or leave a thin last row tile (72, 136, 200, 272 rows), the unmasked
    pointer tiles ran 1.3-2x slower than masked ("dec_") or TMA tiles on an H100 (6396e11:docs/rollout-profile.md,
    issue 39), so no real Qwen3 linear may get one there (the two-part "p2_", stream-K "sk_" and warp-specialized
    "ws_"/"wsx_" tiles are TMA tiles)."""
    for shape, layer, _, _, m, config in _decode_step_picks():
        assert config.startswith(("dec_", "pers_", "tma_", "p2_", "sk_", "ws_", "wsx_")), (shape, layer, m, config)


_STREAMK = r"""
import torch
import spirl_kernels.gemm as gemm
from triton.tools.tensor_descriptor import TensorDescriptor as D

# float32 (the interpreter's bf16 dot is not the GPU's): the stream-K kernel against the persistent kernel
# with the same tiles, whose K loop runs whole in one program. SM counts 2-7 cut tiles at many points.
torch.manual_seed(0)
bad, cut, launches = [], 0, 0
for sms in (2, 3, 5, 7):
    for m, n, k in [(20, 1000, 136), (130, 1032, 200), (72, 520, 520), (200, 264, 1000), (20, 40, 72)]:
        x, w = torch.randn(m, k), torch.randn(n, k)
        for c in [c for c in gemm.CONFIGS if c.startswith("sk_")]:
            bm, bn = gemm.CONFIGS[c][:2]
            per_row = gemm.streamk_per_row(m, n, bm, bn, sms)
            programs = -(-m // bm) * per_row
            launches += 1
            cut += (-(-n // bn) * -(-k // 64)) % per_row != 0
            y, ref = torch.full((m, n), float("nan")), torch.full((m, n), float("nan"))
            flags = torch.zeros(programs, dtype=torch.int32)
            gemm._bi_matmul_streamk_kernel[(programs,)](D.from_tensor(x, [bm, 64]), D.from_tensor(w, [bn, 64]),
                D.from_tensor(y, [bm, bn]), torch.empty(programs, bm, bn), flags, m, n, k, per_row,
                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64)
            gemm._bi_matmul_persistent_kernel[(1,)](D.from_tensor(x, [bm, 64]), None, D.from_tensor(w, [bn, 64]),
                D.from_tensor(ref, [bm, bn]), None, m, n, k, BLOCK_M=bm, BLOCK_M2=0, BLOCK_N=bn, BLOCK_K=64,
                GROUP_M=1, NUM_SMS=1)
            if not torch.equal(y, ref) or flags.any():
                bad.append((sms, m, n, k, c))
print(bad or ("ok" if cut >= 20 else f"only {cut} of {launches} launches cut a tile"))
"""


@pytest.mark.slow
def test_stream_k_carries_each_tile_s_accumulator_exactly_and_leaves_the_flags_zero(triton_interpreter):
    """Every element of the stream-K kernel equals the one-program K loop's (the carried fp32 accumulator
    is the register one), no element is left unwritten (NaN-filled outputs), and each launch leaves its
    flags at zero for the next. At least 20 of the 120 launches cut tiles (21 when written)."""
    assert triton_interpreter("-c", _STREAMK, timeout=600).strip() == "ok"


def test_deep_pipeline_decode_tiles_are_picked_only_where_they_make_one_wave():
    """The 8-stage pointer tiles and the warp-specialized tiles (both 2026-11-27) hold one program per SM
    (160-205 KB of shared memory); picked where the tiles would need a second wave, a program would wait for an
    SM (they were timed, and won, only as one wave). Each must also be picked somewhere among the real Qwen3
    linears at decode steps of 65-512 rows, and the warp-specialized tiles of 128 x 128 elements or more only
    where K is at least 2560 (at K = 2048 the persistent kernel was faster there: Qwen3-1.7B qkv, H100, 2026-11-27)."""
    import triton

    from spirl_kernels.gemm import _H100_SMS

    deep = ("dec_m64_n64_s8", "ws_m64_n128_s8", "ws_m128_n64_s8", "ws_m128_n128_s6", "ws_m64_n256_s5")
    seen = set()
    for shape, _, n, k, m, config in _decode_step_picks():
        if config in deep:
            bm, bn = CONFIGS[config][:2]
            assert triton.cdiv(m, bm) * triton.cdiv(n, bn) <= _H100_SMS, (shape, n, k, m, config)
            assert bm * bn < 128 * 128 or k >= 2560, (shape, n, k, m, config)
            seen.add(config)
    assert seen == set(deep)


def test_pointer_tiles_stay_where_they_make_one_wave_at_up_to_128_rows():
    """At decode steps of 65-128 rows, where the pointer kernel's 64x32 or 64x64 tiles make one wave, they beat
    the warp-specialized tiles at K < 8192 (Qwen3-1.7B o/down, 8B o at 72-128 rows, H100, 2026-11-27), so those keep
    them; at 8B down (K = 12,288) the warp-specialized tiles won (128 rows: 43.9 us against 48.2)."""
    import triton

    from spirl_kernels.gemm import _H100_SMS

    for shape, layer, n, k, m, config in _decode_step_picks():
        if m <= 128 and triton.cdiv(m, 64) * triton.cdiv(n, 64) <= _H100_SMS:
            assert config in (("dec_m64_n32", "dec_m64_n64_s8") if k < 8192 else ("ws_m64_n128_s8",)), (
                shape, layer, m, config)
