"""Trainer forward with the vllm kernel backend is batch invariant (bitwise), H100 + vLLM 0.26.0."""

from __future__ import annotations

import pytest
import torch

from torchtitan_compat import pack
from weights_vllm_compat import load_model

LENGTHS = [37, 1, 300, 129, 2048, 5, 700, 64]  # the probe sequence first, then 7 others


def logits_of(model, seqs):
    p = pack(seqs, device="cuda")
    with torch.no_grad():
        out = model(p.tokens, p.positions, p.cu_seqlens, p.max_seqlen)
    return [out[a:b] for a, b in p.spans()]


@pytest.mark.parametrize("ckpt", ["gpu_tiny_ckpt", "gpu_06b_4layer_ckpt"])
def test_sequence_alone_equals_packed_with_seven_others(ckpt, request):
    model = load_model(request.getfixturevalue(ckpt), device="cuda", dtype=torch.bfloat16,
                       backend="vllm")
    assert model.backend.name == "vllm"
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 151643, (n,), generator=g).tolist() for n in LENGTHS]
    packed = logits_of(model, seqs)
    for i in (0, 2, 4):  # three members, each alone
        alone = logits_of(model, [seqs[i]])[0]
        assert torch.equal(alone, packed[i]), f"sequence {i} (len {LENGTHS[i]}) differs when packed"
    reordered = logits_of(model, seqs[::-1])[::-1]
    assert all(torch.equal(a, b) for a, b in zip(reordered, packed))
