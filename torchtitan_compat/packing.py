"""Pack token sequences into vLLM's flat layout (one token axis plus `cu_seqlens`)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import numpy as np
import torch


@dataclass
class PackedTokens:
    tokens: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], 0..len-1 within each sequence
    cu_seqlens: torch.Tensor  # int32 [B+1]
    max_seqlen: int

    def to(self, device) -> "PackedTokens":
        return PackedTokens(self.tokens.to(device), self.positions.to(device),
                            self.cu_seqlens.to(device), self.max_seqlen)

    def spans(self) -> list[tuple[int, int]]:
        b = self.cu_seqlens.tolist()
        return list(zip(b[:-1], b[1:]))


def flatten(sequences: Sequence[Sequence], dtype, total: int) -> torch.Tensor:
    """The concatenation of `sequences` (`total` elements in all) as one CPU tensor. Through numpy:
    `np.fromiter` converts Python ints ~8x faster than `torch.tensor(list)`, and the trainer packs
    every batch on the host before its forward, with the GPU waiting."""
    return torch.from_numpy(np.fromiter(chain.from_iterable(sequences), dtype=dtype, count=total))


def pack(sequences: Sequence[Sequence[int]], device=None) -> PackedTokens:
    """Concatenate token-id sequences; each must be non-empty."""
    if not sequences:
        raise ValueError("pack() needs at least one sequence")
    lengths = [len(s) for s in sequences]
    if min(lengths) == 0:
        raise ValueError(f"sequence {lengths.index(0)} is empty; every packed sequence needs >= 1 token")
    tokens = flatten(sequences, np.int64, sum(lengths))
    lens = torch.tensor(lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    starts = torch.repeat_interleave(cu[:-1].long(), lens)
    positions = torch.arange(len(tokens), dtype=torch.long) - starts
    packed = PackedTokens(tokens, positions, cu, max(lengths))
    return packed.to(device) if device is not None else packed
