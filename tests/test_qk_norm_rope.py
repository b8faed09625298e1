"""spirl_kernels.qk_norm_rope on CPU: a row block that would reduce rows in another order than vLLM's norm is
refused before any kernel runs, and in Triton's interpreter the multi-row kernel and the q+k launch write
the same rows as the one-row kernel (the kernels' bits are proven against vLLM's ops in
tests/gpu/test_ops_vs_vllm.py)."""

from __future__ import annotations

import pytest
import torch

from spirl_kernels.qk_norm_rope import default_rows, norm_rope, norm_rope_qk


@pytest.mark.parametrize("rows,d,why", [(0, 128, "power of two"), (3, 128, "power of two"), (24, 128, "power of two"),
                                        (2, 128, "another order"), (4, 128, "another order"),
                                        (8, 64, "another order"), (16, 32, "another order")])
def test_rows_per_program_that_would_change_the_reduction_are_refused(rows, d, why):
    x = torch.zeros(4, 2, d, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=why):
        norm_rope(x, torch.ones(d, dtype=torch.bfloat16), 1e-6, torch.zeros(4, dtype=torch.long),
                  torch.zeros(8, d, dtype=torch.bfloat16), rows_per_program=rows)


@pytest.mark.parametrize("k_shape,n_pos", [((5, 2, 128), 4), ((4, 2, 64), 4), ((4, 2, 128), 3)])
def test_q_and_k_of_other_tokens_or_head_sizes_are_refused(k_shape, n_pos):
    q, w = torch.zeros(4, 8, 128, dtype=torch.bfloat16), torch.ones(128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must share the token count and head size"):
        norm_rope_qk(q, torch.zeros(k_shape, dtype=torch.bfloat16), w, w, 1e-6, torch.zeros(n_pos, dtype=torch.long),
                     torch.zeros(8, 128, dtype=torch.bfloat16))


def test_default_rows():
    assert default_rows(4095, 128) == 1 and default_rows(4096, 128) == 8
    assert default_rows(10**6, 64) == 16 and default_rows(10**6, 256) == 4
    assert default_rows(10**6, 32) == 1 and default_rows(10**6, 512) == 1  # layouts not proven: one row


_INTERPRETED = r"""
import torch
from spirl_kernels.qk_norm_rope import norm_rope, norm_rope_qk

torch.manual_seed(0)
for t, hq, hk, d, wider in [(37, 16, 8, 128, 3), (5, 8, 2, 64, 1), (9, 4, 4, 256, 2)]:
    row = (torch.randn(t, (hq + hk + wider) * d) * 3).to(torch.bfloat16)   # heads as slices of a wider qkv row
    q, k = row[:, : hq * d].view(t, hq, d), row[:, hq * d:(hq + hk) * d].view(t, hk, d)
    wq, wk = (1 + 0.3 * torch.randn(2, d)).to(torch.bfloat16)
    pos = torch.randint(0, 500, (t,))
    freqs = torch.outer(torch.arange(512, dtype=torch.float), 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float) / d))
    cache = torch.cat([freqs.cos(), freqs.sin()], -1).to(torch.bfloat16)
    one_q, one_k = norm_rope(q, wq, 1e-6, pos, cache, rows_per_program=1), norm_rope(k, wk, 1e-6, pos, cache, 1)
    for rows in (1, 1024 // d, 16, 64):
        assert torch.equal(norm_rope(q, wq, 1e-6, pos, cache, rows_per_program=rows), one_q), (t, hq, d, rows)
        both = norm_rope_qk(q, k, wq, wk, 1e-6, pos, cache, rows_per_program=rows)
        assert torch.equal(both[0], one_q) and torch.equal(both[1], one_k), (t, hq, hk, d, rows)
print("ok")
"""


def test_the_multi_row_kernel_computes_the_same_rows_in_triton_s_interpreter(triton_interpreter):
    """Indexing check on CPU (Triton's interpreter, TRITON_INTERPRET=1, in a fresh process because the
    variable is read when the kernels are defined): the multi-row kernel reads each row's head, token
    position and strided slice and writes the same output rows as the one-row kernel, with partial last
    blocks (37 x 16 rows in blocks of 64) and heads that are a slice of a wider row; the q+k launch writes
    q's rows and k's rows where the two one-tensor calls do. The interpreter sums with NumPy, so this says
    nothing about GPU bits; tests/gpu/test_ops_vs_vllm.py proves those."""
    assert triton_interpreter("-c", _INTERPRETED, timeout=300).strip() == "ok"
