"""Pack token sequences into vLLM's flat layout (one token axis plus `cu_seqlens`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


def pack(sequences: Sequence[Sequence[int]], device=None) -> PackedTokens:
    """Concatenate token-id sequences; each must be non-empty."""
    if not sequences:
        raise ValueError("pack() needs at least one sequence")
    lengths = [len(s) for s in sequences]
    if min(lengths) == 0:
        raise ValueError(f"sequence {lengths.index(0)} is empty; every packed sequence needs >= 1 token")
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    positions = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    packed = PackedTokens(tokens, positions, cu, max(lengths))
    return packed.to(device) if device is not None else packed
