"""Page-locked host copies of many tensors, packed so that torch's pinned allocator wastes little.

torch's caching host allocator rounds every pinned allocation up to a power of two (a Qwen3-30B-A3B layer's
stacked gate/up experts, 0.75 GiB, takes 1 GiB: its 56.3 GiB of adapted tensors pinned one by one take about 76 GiB;
a run that did so had 97.7 GB of host memory in use at its peak on an H200 host). `PinnedPool` instead places the tensors in buffers of exactly BUCKET bytes (a power of two, so
nothing is rounded), each tensor in the first buffer with room for it (first fit, as they arrive), a new buffer
when none has. A tensor larger than a bucket gets a
buffer of its own (rounded as torch rounds it). `footprint` is the same layout computed from sizes alone, for
the host memory plan.
"""

from __future__ import annotations

import torch

BUCKET = 1 << 31
"""Bytes of one pinned buffer (2 GiB)."""
ALIGN = 512
"""Each tensor starts at a multiple of this many bytes of its buffer."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _place(used: list[int], n: int) -> int:
    """First fit: the index of the first buffer (bytes used in each, `used`) with room for n bytes, a new one
    appended if none has; `used` is updated."""
    for i, u in enumerate(used):
        if u + n <= BUCKET:
            used[i] = u + _round_up(n, ALIGN)
            return i
    used.append(_round_up(n, ALIGN))
    return len(used) - 1


def footprint(sizes) -> int:
    """Pinned bytes that `PinnedPool.copy` of tensors of `sizes` bytes, in this order, allocates."""
    used: list[int] = []
    big = 0
    for n in sizes:
        if n > BUCKET:
            big += _power_of_two(n)
        else:
            _place(used, n)
    return big + BUCKET * len(used)


class PinnedPool:
    """`copy(t)`: a page-locked host copy of `t` (a view into a shared buffer; the module docstring). `pin`: False
    lays the buffers out the same way in ordinary memory (a machine without CUDA)."""

    def __init__(self, pin: bool = True):
        self.pin = pin
        self._buffers: list[torch.Tensor] = []
        self._used: list[int] = []
        self.reserved = 0
        """Pinned bytes allocated so far."""

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if n > BUCKET:
            self.reserved += _power_of_two(n)
            return t.pin_memory() if self.pin else t.clone()
        i = _place(self._used, n)
        if i == len(self._buffers):
            self._buffers.append(torch.empty(BUCKET, dtype=torch.uint8, pin_memory=self.pin))
            self.reserved += BUCKET
        start = self._used[i] - _round_up(n, ALIGN)
        out = self._buffers[i][start:start + n].view(t.dtype).view(t.shape)
        out.copy_(t)
        return out
