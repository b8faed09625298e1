"""spirl.core.pinned on a GPU: the pool's views are page-locked and copy to the GPU asynchronously with their
values; the pool takes less pinned memory than pinning each tensor (torch rounds each to a power of two)."""

from __future__ import annotations

import torch

from spirl.core import pinned


def test_pool_views_are_pinned_and_copy_exactly():
    g = torch.Generator().manual_seed(0)
    sizes = [(1536, 2048), (2048, 768), (40, 1024), (3000, 7)]  # 6 MiB, 3 MiB, ... of bf16
    tensors = [torch.randn(s, generator=g).to(torch.bfloat16) for s in sizes]
    pool = pinned.PinnedPool()
    views = [pool.copy(t) for t in tensors]
    assert all(v.is_pinned() for v in views)
    on_gpu = [v.to("cuda", non_blocking=True) for v in views]
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), t) for a, t in zip(on_gpu, tensors))
    assert pool.reserved == pinned.footprint([t.numel() * t.element_size() for t in tensors]) == pinned.BUCKET
