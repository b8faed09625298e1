"""The Triton attention backward (spirl_kernels/attention_backward.py) under the Triton interpreter, on CPU.

The kernels run with TRITON_INTERPRET=1 in a subprocess (the variable is read when `@triton.jit`
decorates a function, so it must be set before the module is imported, and setting it here would
leak into every other test). The subprocess runs every case and prints one JSON line of results;
the tests below assert on it.

Checked, with packed ragged sequences of lengths 1, 17, 64, 130 (none a block multiple; 130 spans
two 128-row and three 64-row blocks) plus an empty one:
  * gradients against the float64 reference backward (`bib.attention`'s AttentionFunction.backward,
    fed the same saved out and lse), for GQA ratios 1, 2, 4, head dims 64 and 128, bf16 and fp16,
    the production configs and a small-tile config (16/32 rows, many blocks per sequence);
  * bitwise batch invariance: each sequence's dq/dk/dv rows alone equal (torch.equal) its rows
    packed among the others, in two different orders (so at different offsets);
  * every output element is written: outputs preallocated full of NaN, including rows outside every
    sequence (cu_seqlens not starting at 0 nor ending at T), which must come back as zeros;
  * strided inputs (q, k, v as views of one fused qkv tensor, a stride-0 dout) give the same bits
    as contiguous copies; two runs give the same bits.

Tolerance: ||dx - dx_ref|| / ||dx_ref|| per tensor (over all rows) < 2e-2 for bf16, 3e-3 for fp16.
The kernel rounds P and dS to the input dtype before their tensor-core products and rounds the
outputs once; with bf16 (unit roundoff 2^-8 ~ 3.9e-3) the observed error is ~6e-3 of the norm, with
fp16 (2^-11 ~ 4.9e-4) ~3e-4. A wrong formula (a missing Delta, a misplaced mask, a wrong GQA head)
is off by O(1). A per-row or elementwise bound would not work: a length-1 sequence's exact dq is 0
(P = 1, dP = Delta) and the kernel returns fp32 rounding noise (~1e-7) there.

Interpreter caveat: triton's interpreter stores bf16 as raw uint16 and its `tl.dot` multiplies
those integers (garbage for bf16 operands; fp16 is fine). The worker patches the interpreter's dot
to widen bf16 operands to fp32 first - exact, since bf16 -> fp32 is exact and the kernel
accumulates in fp32. The GPU path is untouched by this.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REL_TOL = {"bfloat16": 2e-2, "float16": 3e-3}
LENGTHS = [1, 17, 64, 0, 130]
CASES = [  # name, (hq, hk, head_dim, dtype, small_tiles)
    ("mha_d64", (2, 2, 64, "bfloat16", False)),
    ("gqa2_d64", (4, 2, 64, "bfloat16", False)),
    ("gqa4_d64", (4, 1, 64, "bfloat16", False)),
    ("gqa2_d128", (4, 2, 128, "bfloat16", False)),
    ("gqa4_d128", (4, 1, 128, "bfloat16", False)),
    ("mha_d128_fp16", (2, 2, 128, "float16", False)),
    ("gqa2_d64_small_tiles", (4, 2, 64, "bfloat16", True)),
]


# --------------------------------------------------------------------------------------------
# Worker: runs in the TRITON_INTERPRET=1 subprocess
# --------------------------------------------------------------------------------------------


def _patch_interpreter_bf16_dot():
    """Widen bf16 (stored as uint16 by the interpreter) dot operands to fp32; see the docstring."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype == tl.bfloat16 and h.data.dtype == np.uint16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, widen(a), widen(b), d, *args, **kwargs)

    interpreter.InterpreterBuilder.create_dot = create_dot


def _worker() -> dict:
    import warnings

    import torch

    sys.path.insert(0, str(ROOT))
    import batch_invariant_backward as bib
    from spirl_kernels.attention_backward import AttentionBwdConfig, attention_backward
    from torchtitan_compat.attention import varlen_causal_attention

    _patch_interpreter_bf16_dot()
    warnings.filterwarnings("ignore", category=RuntimeWarning)  # exp2 overflow in masked entries
    small = AttentionBwdConfig(block_m1=16, block_n1=32, warps1=4, stages1=1,
                               block_m2=32, block_n2=16, warps2=4, stages2=1)

    def cu_of(lengths, first=0):
        return torch.tensor([first] + [first + sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)

    class SavedForward:
        """A backend whose forward returns given (out, lse): the reference backward then sees
        exactly the saved tensors the kernel sees."""

        def __init__(self, out, lse):
            self.out, self.lse = out, lse

        def attention(self, q, k, v, cu_seqlens, max_seqlen, scale):
            return self.out.to(q.dtype), self.lse.to(q.dtype)

    def make(lengths, hq, hk, d, dtype, seed, pad_front=0, pad_back=0):
        gen = torch.Generator().manual_seed(seed)
        total = pad_front + sum(lengths) + pad_back
        q, k, v = (torch.randn(total, h, d, generator=gen).to(dtype) for h in (hq, hk, hk))
        dout = torch.randn(total, hq, d, generator=gen).to(dtype)
        cu = cu_of(lengths, pad_front)
        out, lse = torch.zeros_like(q), torch.zeros(hq, total)
        o, l = varlen_causal_attention(q, k, v, cu, d ** -0.5)  # rows outside stay 0
        sl = slice(pad_front, pad_front + sum(lengths))
        out[sl], lse[:, sl] = o[sl], l[:, sl]
        return q, k, v, out, dout, lse, cu

    def reference(q, k, v, out, dout, lse, cu, scale):
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        o = bib.attention(q64, k64, v64, cu, 0, scale, SavedForward(out.double(), lse.double()))
        o.backward(dout.double())
        return q64.grad, k64.grad, v64.grad

    def run(q, k, v, out, dout, lse, cu, config=None, poison=False):
        bufs = {}
        if poison:
            bufs = {"dq": torch.full_like(q, float("nan")), "dk": torch.full_like(k, float("nan")),
                    "dv": torch.full_like(v, float("nan"))}
        max_len = int((cu[1:] - cu[:-1]).max())
        return attention_backward(q, k, v, out, dout, lse, cu, max_len, q.shape[-1] ** -0.5,
                                  config=config, **bufs)

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    def rows_of(grads, cu, i):
        s, e = int(cu[i]), int(cu[i + 1])
        return [g[s:e] for g in grads]

    res = {"accuracy": {}, "invariance": {}, "poison": {}, "misc": {}}
    for idx, (name, (hq, hk, d, dtype_name, small_tiles)) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        config = small if small_tiles else None
        args = make(LENGTHS, hq, hk, d, dtype, seed=idx)
        got = run(*args, config=config, poison=True)
        ref = reference(*args, d ** -0.5)
        res["accuracy"][name] = {n: rel(g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref)}
        res["poison"][name] = all(not g.isnan().any() for g in got)

        # batch invariance: alone, and packed in reverse order (other offsets, other neighbours)
        q, k, v, out, dout, lse, cu = args
        order = list(range(len(LENGTHS)))[::-1]
        perm = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in order])
        cu_rev = cu_of([LENGTHS[i] for i in order])
        got_rev = run(q[perm], k[perm], v[perm], out[perm], dout[perm], lse[:, perm], cu_rev, config=config)
        same = True
        for i, length in enumerate(LENGTHS):
            if length == 0:
                continue
            s, e = int(cu[i]), int(cu[i + 1])
            alone = run(q[s:e], k[s:e], v[s:e], out[s:e], dout[s:e], lse[:, s:e].contiguous(),
                        cu_of([length]), config=config)
            j = order.index(i)
            for a, p, r in zip(alone, rows_of(got, cu, i), rows_of(got_rev, cu_rev, j)):
                same &= torch.equal(a, p) and torch.equal(a, r)
        res["invariance"][name] = same

    # rows outside every sequence (cu_seqlens starts at 3 and ends 5 rows before T): zeros
    args = make([17, 40], 4, 2, 64, torch.bfloat16, seed=10, pad_front=3, pad_back=5)
    got = run(*args, poison=True)
    ref = reference(*args, 64 ** -0.5)
    outside = torch.cat([torch.arange(0, 3), torch.arange(60, 65)])
    res["misc"]["outside_rows_zero"] = all(bool((g[outside] == 0).all()) for g in got)
    res["misc"]["outside_rows_accuracy"] = max(rel(g, r) for g, r in zip(got, ref))

    # strided views: q, k, v slices of one fused qkv, a stride-0 dout, lse a slice of a wider buffer
    hq, hk, d = 4, 2, 64
    q, k, v, out, dout, lse, cu = make([17, 64, 30], hq, hk, d, torch.bfloat16, seed=11)
    qkv = torch.cat([q, k, v], dim=1)
    qv, kv_, vv = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    dout_row = dout[:1].expand_as(dout)
    lse_wide = torch.zeros(hq, lse.shape[1] + 7)
    lse_wide[:, :lse.shape[1]] = lse
    lse_view = lse_wide[:, :lse.shape[1]]
    a = run(qv, kv_, vv, out, dout_row, lse_view, cu)
    b = run(q, k, v, out, dout_row.contiguous(), lse, cu)
    c = run(q, k, v, out, dout_row.contiguous(), lse, cu)
    res["misc"]["strided_equals_contiguous"] = all(torch.equal(x, y) for x, y in zip(a, b))
    res["misc"]["two_runs_equal"] = all(torch.equal(x, y) for x, y in zip(b, c))
    return res


# --------------------------------------------------------------------------------------------
# Tests (main pytest process)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(triton_interpreter):
    pytest.importorskip("triton")
    return json.loads(triton_interpreter(__file__, timeout=300).strip().splitlines()[-1])


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_matches_float64_reference(results, case):
    tol = REL_TOL[dict(CASES)[case][3]]
    errs = results["accuracy"][case]
    assert all(e < tol for e in errs.values()), f"{case}: relative errors {errs} (tolerance {tol})"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_sequence_grads_bitwise_same_alone_or_packed(results, case):
    assert results["invariance"][case]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_output_element_written(results, case):
    assert results["poison"][case], "NaN left in a poisoned output: some element was never written"


def test_rows_outside_every_sequence_are_zero(results):
    assert results["misc"]["outside_rows_zero"]
    assert results["misc"]["outside_rows_accuracy"] < REL_TOL["bfloat16"]


def test_strided_inputs_and_repeat_runs_bitwise(results):
    assert results["misc"]["strided_equals_contiguous"]
    assert results["misc"]["two_runs_equal"]


def test_rejects_unsupported_shapes():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    sys.path.insert(0, str(ROOT))
    from spirl_kernels.attention_backward import attention_backward

    def call(hq=4, hk=2, d=64, dtype=torch.bfloat16):
        q, k = torch.zeros(8, hq, d, dtype=dtype), torch.zeros(8, hk, d, dtype=dtype)
        return attention_backward(q, k, k, q, q, torch.zeros(hq, 8), torch.tensor([0, 8], dtype=torch.int32), 8, 0.1)

    with pytest.raises(ValueError, match="head_dim 96"):
        call(d=96)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(hq=3, hk=2)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        call(dtype=torch.float32)


if __name__ == "__main__":
    print(json.dumps(_worker()))
