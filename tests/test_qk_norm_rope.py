"""kernels.qk_norm_rope on CPU: a row block that is not a power of two is refused before any kernel
runs, and in Triton's interpreter the multi-row kernel writes the same rows as the one-row kernel (the
kernels' bits are proven against vLLM's ops in tests/gpu/test_ops_vs_vllm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.qk_norm_rope import norm_rope

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("rows", [0, 3, 24])
def test_rows_per_program_must_be_one_or_a_power_of_two(rows):
    x = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        norm_rope(x, torch.ones(128, dtype=torch.bfloat16), 1e-6, torch.zeros(4, dtype=torch.long),
                  torch.zeros(8, 128, dtype=torch.bfloat16), rows_per_program=rows)


_INTERPRETED = r"""
import torch
from kernels.qk_norm_rope import norm_rope

torch.manual_seed(0)
for t, h, d, wider in [(37, 16, 128, 3), (5, 8, 64, 1), (9, 4, 256, 2)]:
    row = (torch.randn(t, (h + wider) * d) * 3).to(torch.bfloat16)   # heads as a slice of a wider qkv row
    x = row[:, : h * d].view(t, h, d)
    w = (1 + 0.3 * torch.randn(d)).to(torch.bfloat16)
    pos = torch.randint(0, 500, (t,))
    freqs = torch.outer(torch.arange(512, dtype=torch.float), 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float) / d))
    cache = torch.cat([freqs.cos(), freqs.sin()], -1).to(torch.bfloat16)
    one = norm_rope(x, w, 1e-6, pos, cache, rows_per_program=1)
    for rows in (2, 16, 64):
        assert torch.equal(norm_rope(x, w, 1e-6, pos, cache, rows_per_program=rows), one), (t, h, d, rows)
print("ok")
"""


def test_the_multi_row_kernel_computes_the_same_rows_in_triton_s_interpreter():
    """Indexing check on CPU (Triton's interpreter, TRITON_INTERPRET=1, in a fresh process because the
    variable is read when the kernels are defined): the multi-row kernel reads each row's head, token
    position and strided slice and writes the same output rows as the one-row kernel, with partial last
    blocks (37 x 16 rows in blocks of 64) and heads that are a slice of a wider row. The interpreter sums
    with NumPy, so this says nothing about GPU bits; tests/gpu/test_ops_vs_vllm.py proves those."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
