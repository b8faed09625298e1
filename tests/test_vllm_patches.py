"""spirl.numerics.vllm_patches on the CPU: what needs no vLLM (the patches themselves run in tests/gpu)."""

from __future__ import annotations

import pytest
from torch import nn

from spirl.numerics.vllm_patches import qk_through_vllms_modules


def layers(n):
    out = []
    for _ in range(n):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        out.append(layer)
    return out


def test_qk_through_vllms_modules_closes_the_fused_path_and_restores_it_even_on_error():
    ls = layers(3)
    ls[0].self_attn.__dict__["_spirl_qk_fusable"] = True  # a layer whose gate already ran
    with pytest.raises(RuntimeError, match="boom"), qk_through_vllms_modules(ls):
        assert [layer.self_attn.__dict__["_spirl_qk_fusable"] for layer in ls] == [False, False, False]
        raise RuntimeError("boom")
    assert ls[0].self_attn.__dict__["_spirl_qk_fusable"] is True
    assert "_spirl_qk_fusable" not in ls[1].self_attn.__dict__  # not yet decided: decided again on next call
