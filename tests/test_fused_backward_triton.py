"""The fused Triton backwards (spirl_kernels/pointwise_backward.py, spirl_kernels/logprob_backward.py) under the
Triton interpreter, on CPU, against the PyTorch form of the same math in float64.

The kernels run with TRITON_INTERPRET=1 in a subprocess (the variable is read when `@triton.jit`
decorates a function). Inputs are float32 and float16 (the interpreter does not model bf16
loads); the GPU test (tests/gpu/test_pointwise_backward_gpu.py) covers bf16 at real widths.
Shapes are odd on purpose: widths not powers of two, rows not multiples of a program's rows, a
strided [T, H, D] view (the q/k norm input), min-p's -inf logits in the logprob rows.
Tolerance, per tensor ||a - b|| / ||b||: float32 1e-5 (float32 rounding of O(10)-term sums),
float16 3e-3 (one fp16 rounding of the output, unit roundoff 4.9e-4, plus fp16 inputs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOL = {"float32": 1e-5, "float16": 3e-3}

WORKER = r'''
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from spirl_kernels.pointwise_backward import rms_norm_backward, swiglu_backward, rotary_backward
from spirl_kernels.logprob_backward import entropy, logprob_backward

def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))

out = {}
g = torch.Generator().manual_seed(0)
for name in ("float32", "float16"):
    dt = getattr(torch, name)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dt)
    res = {}
    # RMSNorm, 2-D and a strided 3-D view; 37 rows (not a multiple of 16), width 48
    for label, x in (("rms2d", r(37, 48, scale=3)), ("rms3d", r(37, 96)[:, :72].reshape(37, 3, 24))):
        w, gr, eps = 1 + 0.1 * r(x.shape[-1]), r(*x.shape), 1e-6
        xd = x.double().requires_grad_(); wd = w.double().requires_grad_()
        y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * wd
        rx, rw = torch.autograd.grad(y, (xd, wd), gr.double())
        dx, dw = rms_norm_backward(x, w, gr, eps)
        res[label] = max(rel(dx, rx), rel(dw, rw))
    x, gr = r(23, 2 * 40, scale=2), r(23, 40)
    xd = x.double().requires_grad_()
    a, b = xd.chunk(2, -1)
    (rx,) = torch.autograd.grad(torch.nn.functional.silu(a) * b, xd, gr.double())
    res["swiglu"] = rel(swiglu_backward(x, gr), rx)
    cache = torch.randn(50, 16, generator=g).to(dt)
    pos = torch.randint(0, 50, (9,), generator=g)
    gr = r(9, 5, 16)
    c, s = cache[pos].double().chunk(2, -1)
    g1, g2 = gr.double().chunk(2, -1)
    rx = torch.cat([g1 * c[:, None] + g2 * s[:, None], g2 * c[:, None] - g1 * s[:, None]], -1)
    res["rotary"] = rel(rotary_backward(gr, pos, cache, dt), rx)
    z = r(7, 5000, scale=3)
    z[:, ::4] = float("-inf")
    ids = torch.arange(7) * 5 + 1
    gl, ge, scale = torch.rand(7, generator=g), torch.rand(7, generator=g), 1 / 0.7
    zd = z.double().requires_grad_()
    logp = torch.log_softmax(zd, -1)
    p = logp.exp()
    H = -(p * logp.masked_fill(p == 0, 0)).sum(-1)
    (rz,) = torch.autograd.grad((logp[torch.arange(7), ids] * gl.double()).sum() + (H * ge.double()).sum(), zd)
    res["entropy"] = rel(entropy(z), H.detach())
    res["logprob_bwd"] = rel(logprob_backward(z, ids, gl, ge, scale), rz * scale)
    res["logprob_bwd_no_entropy_grad"] = rel(logprob_backward(z, ids, gl, None, 1.0),
        torch.autograd.grad((torch.log_softmax(zd, -1)[torch.arange(7), ids] * gl.double()).sum(), zd)[0])
    out[name] = res
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def results(triton_interpreter):
    return json.loads(triton_interpreter("-c", WORKER, str(ROOT), timeout=600).strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("case", ["rms2d", "rms3d", "swiglu", "rotary", "entropy", "logprob_bwd",
                                  "logprob_bwd_no_entropy_grad"])
def test_fused_kernel_matches_float64_math(results, dtype, case):
    assert results[dtype][case] <= TOL[dtype], results[dtype]
