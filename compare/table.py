"""Per-token parity table: engine vs trainer logprob, with bit patterns, for humans."""

from __future__ import annotations

import struct
from typing import Callable

import torch


def f32_hex(x: float) -> str:
    return struct.pack(">f", x).hex()


def bf16_hex(x: float) -> str:
    """Hex of x rounded to bfloat16 (what a bf16 logit of that size looks like)."""
    return f"{torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF:04x}"


def format_rows(token_ids: list[int], engine_lps: torch.Tensor, trainer_lps: torch.Tensor,
                decode: Callable[[int], str] | None = None) -> list[str]:
    """One line per token: position, id, text, engine lp, trainer lp, bf16 hex, f32 hex (both), Δ."""
    header = (f"{'pos':>4} {'id':>7} {'token':<14} {'vllm logprob':>14} {'trainer logprob':>15} "
              f"{'bf16 (v/t)':>11} {'float32 hex (v/t)':>19} {'Δ':>10}")
    lines = [header, "-" * len(header)]
    for j, (tok, a, b) in enumerate(zip(token_ids, engine_lps.tolist(), trainer_lps.tolist())):
        text = repr(decode(tok))[1:-1][:14] if decode else ""
        mark = "" if f32_hex(a) == f32_hex(b) else "  <-- differs"
        lines.append(f"{j:>4} {tok:>7} {text:<14} {a:>14.8f} {b:>15.8f} "
                     f"{bf16_hex(a)}/{bf16_hex(b)} {f32_hex(a)}/{f32_hex(b)} {a - b:>10.2e}{mark}")
    return lines
