"""Eager Triton launches without the JIT's per-call argument binding.

`kernel[grid](*args, **constexprs)` binds and specializes every argument, checks its options, builds a cache key
and looks the compiled kernel up on each call: 42-55 us of host time per GEMM launch on an H100 host (Triton 3.6,
2026-11-27, 6396e11:docs/rollout-profile.md), where cuBLAS's whole `F.linear` took 26-37 us.
That time counts where launches are not replayed from a CUDA graph: vLLM's lm_head (once per decode step, outside
the step's graph) and every kernel of a prefill above the largest captured graph, where the host's time per step
exceeds the GPU's.

`launch` keys each call by what Triton specializes a compiled kernel on, computed here the way Triton 3.6 does:
a tensor argument's dtype and whether its address is 16-byte aligned, a host TMA descriptor's dtype and block
shape, every other argument's value (integers: Triton specializes on 1, on divisibility by 16 and on 32-bit
range, so the value fixes all three), the constexprs and the launch options. The first call with a key goes
through the JIT (which compiles, or finds the compiled kernel) and keeps the `CompiledKernel` it returns; later
calls launch that directly (`CompiledKernel[grid](*args)`: the launcher call the JIT ends in, on the current
stream, with Triton's launch hooks), the arguments in signature order. Under any other Triton than vLLM 0.26's
pin (3.6), or Triton's interpreter, every call takes the JIT.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

_FAST = triton.__version__.split("+")[0] == "3.6.0"
"""The direct launch is written for Triton 3.6: the JIT returns the `CompiledKernel`, whose `[grid]` launches it."""

_MAX_KEYS = 1 << 16
"""Cached launches kept before the cache starts over (one per distinct key: prefill lengths x kernel shapes)."""

_COMPILED: dict[tuple, tuple] = {}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launch code on the host. `triton.cdiv` is a constexpr function (Triton 3.6): called
    from Python it unwraps its arguments first, about 4 us a call on a 2-core host, and `pick_config` made twelve
    such calls for every eager GEMM (vLLM's lm_head, once per decode step; every layer of an eager prefill)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as `triton.next_power_of_2`, without its host-call cost (`cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _spec(arg):
    """What Triton 3.6 specializes a compiled kernel on for one argument (module doc)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if isinstance(arg, TensorDescriptor):
        return arg.base.dtype, tuple(arg.block_shape), arg.padding
    return type(arg), arg  # ints, floats, None: the value (bool and int are different types to Triton)


def launch(kernel, grid: tuple[int, int, int], args: tuple, constexprs: dict, **options) -> None:
    """kernel[grid](*args, **constexprs, **options) (options: num_warps, num_stages, ...); from the second call
    with the same specialization on the current device on, without the JIT's binding (module doc). `args` are the
    kernel's leading parameters, every one that is not a constexpr among them; `constexprs` the rest, by name."""
    if not _FAST or triton.knobs.runtime.interpret:
        kernel[grid](*args, **constexprs, **options)
        return
    key = (kernel, torch.cuda.current_device(), tuple(map(_spec, args)), tuple(constexprs.items()),
           tuple(options.items()))
    hit = _COMPILED.get(key)
    if hit is not None:
        compiled, rest = hit
        compiled[grid](*args, *rest)
        return
    compiled = kernel[grid](*args, **constexprs, **options)
    if len(_COMPILED) >= _MAX_KEYS:
        _COMPILED.clear()
    params = kernel.params[len(args):]  # the constexprs, in signature order, defaults where not given
    _COMPILED[key] = (compiled, tuple(constexprs[p.name] if p.name in constexprs else p.default for p in params))
