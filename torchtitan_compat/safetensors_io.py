"""Safetensors files whose bytes follow from their contents alone.

Why not `safetensors.torch.save_file`: it writes the header's `__metadata__` from a Rust HashMap,
whose order is random per map, so an adapter with two metadata keys (format and SPIRL's base
fingerprint) saved twice is, half of the time, two different files holding the same thing. Here the
header is written by `json` with its metadata keys sorted and the tensors in a fixed order (the
library's: larger elements first, then by name, which keeps every tensor aligned to its element
size), so equal tensors and metadata give equal bytes. The files are what `safe_open` / `load_file`
read: an 8-byte little-endian header length, the JSON header padded with spaces to a multiple of 8
bytes, then the tensors' raw little-endian bytes back to back.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
"""Torch dtypes -> the safetensors names the header spells them with."""


def write_safetensors(path: str | Path, layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                      tensor: Callable[[str], torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file of `layout` (name -> (dtype, shape), in file order), asking `tensor(name)`
    for one tensor at a time (cast to the layout's dtype), so memory stays at one tensor: random
    checkpoints of billions of parameters are written this way. `metadata` goes into the header,
    keys sorted."""
    header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name, (dtype, shape) in layout.items():
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # pad like the reference writer, keeping tensor data 8-aligned
    report_every = offset // 10 if offset > 1 << 30 else None  # progress only for big files
    written, next_report = 0, report_every
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, (dtype, shape) in layout.items():
            t = tensor(name).detach().to("cpu", dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {name} has shape {list(t.shape)}, its header says {list(shape)}")
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            written += t.numel() * t.element_size()
            if report_every and written >= next_report:
                log.info("wrote %.1f of %.1f GB (%d%%)", written / 1e9, offset / 1e9, 100 * written // offset)
                while next_report <= written:
                    next_report += report_every


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (any device; each in its own dtype) as a safetensors file whose bytes depend only on
    the tensors and `metadata`: larger elements first, then by name, metadata keys sorted."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    write_safetensors(path, {k: (tensors[k].dtype, tuple(tensors[k].shape)) for k in order}, tensors.__getitem__,
                      metadata)
