"""The fused Triton backwards (spirl_kernels/pointwise_backward.py, spirl_kernels/logprob_backward.py) against
the PyTorch float32 form of the same math, on the GPU at Qwen3-1.7B widths, and run twice.

Inputs are bf16, as in training; the reference is the PyTorch path of `batch_invariant_backward`
(taken by pretending the tensors are not on tensor cores), which computes in float32 from the same
bf16 inputs. Both round the result to bf16 once, so they agree to bf16 rounding: per tensor
||a - b|| / ||b|| <= 1e-2 (unit roundoff 2^-8 = 3.9e-3; float32 summation order differs). Two runs
of a kernel give torch.equal results.
"""

from __future__ import annotations

import pytest
import torch

import batch_invariant_backward as bib
from torchtitan_compat.ops import ReferenceBackend

REF = ReferenceBackend()
T = 3000


def rand(*shape, scale=1.0, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def grads_of(fn, inputs, upstream, fused: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(bib, "on_tensor_cores", lambda x: False)
            m.setattr(bib, "_fused_rotary", lambda g, d: False)
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return torch.autograd.grad([o for o in outs if o is not None], leaves,
                                   [u for u, o in zip(upstream, outs) if o is not None])


CASES = {
    "rms_norm_2048": lambda: ((rand(T, 2048, scale=3), 1 + 0.1 * rand(2048, seed=1)),
                              lambda x, w: bib.rms_norm(x, w, 1e-6, REF), [rand(T, 2048, seed=2)]),
    "rms_norm_qk_heads_strided": lambda: ((rand(T, 4096, seed=3)[:, :2048].reshape(T, 16, 128),
                                           1 + 0.1 * rand(128, seed=4)),
                                          lambda x, w: bib.rms_norm(x, w, 1e-6, REF), [rand(T, 16, 128, seed=5)]),
    "silu_and_mul_6144": lambda: ((rand(T, 12288, scale=2, seed=6),), lambda x: bib.silu_and_mul(x, REF),
                                  [rand(T, 6144, seed=7)]),
    "rotary_16_8": lambda: ((rand(T, 16, 128, seed=8), rand(T, 8, 128, seed=9)),
                            lambda q, k: bib.rotary(torch.randint(0, 8192, (T,), device="cuda"), q, k,
                                                    REF.rope_cache(128, 8192, 1e6, torch.bfloat16, "cuda"), REF),
                            [rand(T, 16, 128, seed=10), rand(T, 8, 128, seed=11)]),
    "lm_head_T0.7_minp": lambda: ((rand(600, 2048, seed=12), rand(151936, 2048, scale=0.05, seed=13)),
                                  lambda h, w: bib.lm_head_logprobs(h, w, torch.arange(600, device="cuda") * 7, REF,
                                                                    0.7, 0.02, entropy=True),
                                  [torch.rand(600, device="cuda"), torch.rand(600, device="cuda")]),
}


@pytest.mark.parametrize("name", CASES)
def test_fused_backward_matches_pytorch_float32_and_is_deterministic(name, monkeypatch):
    inputs, fn, upstream = CASES[name]()
    torch.manual_seed(0)
    fused = grads_of(fn, inputs, upstream, True, monkeypatch)
    torch.manual_seed(0)
    again = grads_of(fn, inputs, upstream, True, monkeypatch)
    torch.manual_seed(0)
    ref = grads_of(fn, inputs, upstream, False, monkeypatch)
    for a, b, c, x in zip(fused, again, ref, inputs):
        assert a.dtype == x.dtype and torch.equal(a, b)
        err = rel(a, c)
        print(f"{name}: relative error {err:.2e}")
        assert err <= 1e-2, err


def test_fused_entropy_is_the_pytorch_entropy():
    z = rand(500, 151936, scale=3, seed=20)
    z[:, ::3] = float("-inf")  # min-p's cut entries
    from spirl_kernels.logprob_backward import entropy

    got, want = entropy(z), bib._entropy(*bib._log_softmax_and_probs(z))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(entropy(z[100:300]), got[100:300])  # row-wise: the same bits in any chunk
