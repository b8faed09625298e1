"""A fix for Triton's interpreter (TRITON_INTERPRET=1): its bf16 `tl.dot` multiplies bit patterns, not values.

The interpreter keeps bf16 tensors as their raw uint16 bits, and `InterpreterBuilder.create_dot` converts only
fp8 operands before `np.matmul`, so a bf16 dot multiplies the bit patterns as integers. Seen with Triton 3.6,
3.8 and 3.9 (2026-11-27): a 16x16x16 bf16 dot was off by about 2.6e10 in every element. A test that compares
two interpreted kernels then compares garbage, and its float32 sums of ~1e9-sized integers depend on how
NumPy orders them for each tile shape, so it fails or passes by shape. `patch()` makes `create_dot` read bf16
operands as the float32 values their bits encode (a bf16 is the top half of a float32). Call it once at the top
of a script run under the interpreter (tests/conftest.py's `triton_interpreter` fixture runs such scripts).
"""

from __future__ import annotations


def patch() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "reads_bf16_values", False):
        return
    raw_dot = builder.create_dot

    def as_float32(t):
        if t.dtype != tl.bfloat16:
            return t
        return interpreter.TensorHandle((t.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args, **kwargs):
        return raw_dot(self, as_float32(a), as_float32(b), d, *args, **kwargs)

    create_dot.reads_bf16_values = True
    builder.create_dot = create_dot
