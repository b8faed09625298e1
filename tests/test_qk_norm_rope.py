"""kernels.qk_norm_rope's host side on CPU: a row block that is not a power of two is refused before
any kernel runs (the kernels themselves are proven against vLLM's ops in tests/gpu/test_ops_vs_vllm.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.qk_norm_rope import norm_rope


@pytest.mark.parametrize("rows", [0, 3, 24])
def test_rows_per_program_must_be_one_or_a_power_of_two(rows):
    x = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        norm_rope(x, torch.ones(128, dtype=torch.bfloat16), 1e-6, torch.zeros(4, dtype=torch.long),
                  torch.zeros(8, 128, dtype=torch.bfloat16), rows_per_program=rows)
