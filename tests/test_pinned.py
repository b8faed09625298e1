"""spirl.core.pinned: the frozen LoRA base packed into pinned buffers (laid out the same in ordinary memory here),
and the host memory plan's count of it."""

from __future__ import annotations

import torch

from spirl.core import pinned


def test_pool_copies_first_fit_and_counts_what_it_allocates(monkeypatch):
    """Buckets of 4 KiB: tensors of 1.5 KiB fill the first buffer's room before a new one is taken (first fit), a
    tensor larger than a bucket gets a power-of-two buffer of its own, every copy equals its source, and
    `reserved` is what `footprint` computes from the sizes alone."""
    monkeypatch.setattr(pinned, "BUCKET", 4096)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g).to(dt) for n, dt in
               ((384, torch.float32), (768, torch.bfloat16), (300, torch.float32), (5000, torch.float32),
                (200, torch.bfloat16), (128, torch.float64))]
    pool = pinned.PinnedPool(pin=False)
    copies = [pool.copy(t) for t in tensors]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(copies, tensors))
    sizes = [t.numel() * t.element_size() for t in tensors]
    assert pool.reserved == pinned.footprint(sizes) == 2 * 4096 + 32768
    assert copies[4].untyped_storage().data_ptr() == copies[0].untyped_storage().data_ptr()  # 400 B fit in the 1st
    tensors[0].zero_()
    assert copies[0].abs().sum() > 0  # copies, not views of the sources


def test_host_plan_counts_the_pool_not_the_raw_bytes():
    """Qwen3-30B-A3B with LoRA on every projection and the experts: the pinned base is the pool's 2 GiB buffers,
    within 11 % above the 56.3 GiB of tensors (torch's allocator rounding each tensor up to a power of two would
    take 75 GiB)."""
    from spirl.core import memory_plan as mp
    from spirl.core.config import TrainConfig
    from torchtitan_compat.config import hf_config_for_shape, model_args_from_hf_config
    from torchtitan_compat.lora import LoRASpec, parse_targets

    args = model_args_from_hf_config(hf_config_for_shape("Qwen3-30B-A3B"))
    spec = LoRASpec(16, 32.0, parse_targets("all-linear,lm_head"))
    cfg = TrainConfig(lora_rank=16, lora_targets="all-linear,lm_head")
    raw = mp._lora_parts(args, TrainConfig(lora_base="gpu"), spec, 2)["frozen base"]
    est = mp.host_estimate(args, cfg, 1, spec).parts["pinned frozen base"]
    assert est % pinned.BUCKET == 0 and raw < est < 1.11 * raw
