"""Fused Triton backwards of the trainer's row-wise ops: RMSNorm, SiLU-and-mul, neox rotary.

Why: written as PyTorch expressions, each of these backwards is 5-15 elementwise kernels over
float32 copies of [tokens, width] tensors; at Qwen3-1.7B, 8 x 1024 tokens, they took more GPU
time than every backward GEMM together (compare/profile_trainer.py on an H100). Here each is one
pass that reads the bf16 inputs once, does the math in fp32 registers and writes bf16 once.

Math (the same as `batch_invariant_backward`'s autograd Functions, which keep the PyTorch form
for the CPU and as the reference these kernels are tested against):
    RMSNorm  y = x * r * w,  r = 1 / sqrt(mean(x^2) + eps), per row of N:
             dx = r * (g w) - x * r^3 * mean(g w x),   dw = sum over rows of g * x * r
    SwiGLU   out = silu(a) * b for x = [a | b], s = sigmoid(a):
             da = g * b * s * (1 + a (1 - s)),   db = g * a * s
    rotary   (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) per head; its transpose:
             (g1, g2) -> (g1 c + g2 s, g2 c - g1 s),  c, s = the cache row of the token's position

Determinism: one program owns each output element; RMSNorm's dw is reduced in two fixed stages
(each program sums its ROWS rows in order into one partial row, then torch sums the partials),
so the bits depend only on the shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RMS_ROWS = 16
"""Rows per RMSNorm-backward program (one dw partial each)."""
SWIGLU_BLOCK = 1024


@triton.jit
def _rms_norm_bwd_kernel(X, G, W, DX, DW_PART, R, H, N, eps, sxt, sxh, sgt, sgh,
                         ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(ROWS):
        r = pid * ROWS + i
        mask = cmask & ((cols * 0 + r) < R)  # a vector mask (the interpreter takes no scalar one)
        t = (r // H).to(tl.int64)
        h = (r % H).to(tl.int64)
        x = tl.load(X + t * sxt + h * sxh + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + t * sgt + h * sgh + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        gw = g * w
        dx = rstd * gw - x * (rstd * rstd * rstd) * (tl.sum(gw * x, axis=0) / N)
        tl.store(DX + r.to(tl.int64) * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
        acc += g * x * rstd
    tl.store(DW_PART + pid.to(tl.int64) * N + cols, acc, mask=cmask)


def _as_rows(t: torch.Tensor):
    """[..., N] with unit last stride as (T, H, stride_t, stride_h): [T, N] or [T, H, N] views."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float):
    """(dx like x, dw float32 [N]) of y = rms_norm(x) * w; x and grad [T, N] or [T, H, N]."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    grad = grad.reshape(x.shape)
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    t, h, sxt, sxh = _as_rows(x)
    _, _, sgt, sgh = _as_rows(grad)
    n = x.shape[-1]
    rows = t * h
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    programs = triton.cdiv(rows, RMS_ROWS)
    part = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](x, grad, weight, dx, part, rows, h, n, eps, sxt, sxh, sgt, sgh,
                                      ROWS=RMS_ROWS, BLOCK_N=triton.next_power_of_2(n), num_warps=4)
    return dx, part.sum(0)


@triton.jit
def _swiglu_bwd_kernel(X, G, DX, I, sxr, sgr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    a = tl.load(X + row * sxr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * sxr + I + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * sgr + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    da = g * b * s * (1.0 + a * (1.0 - s))
    db = g * a * s
    tl.store(DX + row * 2 * I + cols, da.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * 2 * I + I + cols, db.to(DX.dtype.element_ty), mask=mask)


def swiglu_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dx [..., 2I] of out = silu(x[..., :I]) * x[..., I:], grad [..., I]."""
    two_i = x.shape[-1]
    x2 = x.reshape(-1, two_i)
    g2 = grad.reshape(-1, two_i // 2)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    grid = (x2.shape[0], triton.cdiv(two_i // 2, SWIGLU_BLOCK))
    _swiglu_bwd_kernel[grid](x2, g2, dx, two_i // 2, x2.stride(0), g2.stride(0), BLOCK=SWIGLU_BLOCK, num_warps=4)
    return dx.reshape(x.shape)


@triton.jit
def _rotary_bwd_kernel(G, DX, POS, CACHE, H, sgt, sgh, scp, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = (heads < H)[:, None]
    pos = tl.load(POS + t).to(tl.int64)
    c = tl.load(CACHE + pos * scp + d).to(tl.float32)[None, :]
    s = tl.load(CACHE + pos * scp + HALF + d).to(tl.float32)[None, :]
    base = G + t * sgt + heads[:, None].to(tl.int64) * sgh + d[None, :]
    g1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    g2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out = DX + (t * H + heads[:, None].to(tl.int64)) * 2 * HALF + d[None, :]
    tl.store(out, (g1 * c + g2 * s).to(DX.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (g2 * c - g1 * s).to(DX.dtype.element_ty), mask=mask)


def rotary_backward(grad: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """dx [T, H, D] of the neox rotation of x [T, H, D] at `positions`; the cache [P, D] = [cos | sin]
    is read as the forward applied it: cast to the activation dtype, then widened to fp32."""
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    cache = cos_sin_cache.to(out_dtype)
    t, h, d = grad.shape
    dx = torch.empty(t, h, d, dtype=out_dtype, device=grad.device)
    block_h = min(triton.next_power_of_2(h), 16)
    _rotary_bwd_kernel[(t, triton.cdiv(h, block_h))](grad, dx, positions, cache, h, grad.stride(0), grad.stride(1),
                                                     cache.stride(0), HALF=d // 2, BLOCK_H=block_h, num_warps=4)
    return dx
