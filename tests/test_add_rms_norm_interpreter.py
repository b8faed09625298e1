"""spirl_kernels/add_rms_norm.py on CPU, in Triton's interpreter: the one-pass tile's indexing and math.

Small-integer inputs make the residual add and the sum of squares exact in float32 whatever order they are added
in, so the residual must equal the reference bit for bit, and so must every element the kernel must not touch
(x's neighbours in a wider buffer). The output is held to one bf16 step (|out - ref| <= 2**-7 |ref|): the
interpreter does the kernel's scalar math in NumPy, whose promotions (a float32 sum over an int32 width) round the
mean and 1/rms differently from the GPU's float32, which moved some outputs by one bf16 step (measured relative
difference up to 0.0073 against the bound's 0.0078). A tile row, mask or stride that reads or writes the wrong
elements, or a padded block that leaks into the sum, is off by far more. GPU bits (the reduction tree against
vLLM's kernel) are proven by tests/gpu/test_ops_vs_vllm.py.
"""

from __future__ import annotations

_INTERPRETED = r"""
import torch
from spirl_kernels.add_rms_norm import add_rms_norm_

torch.manual_seed(0)
bad = []
# widths: one block, two, a tail (3,000: 3 blocks, the last part-masked), 5 blocks padded to 8 tile rows
for n in (1024, 2048, 3000, 5120):
    for rows in (1, 3):
        wide = torch.randint(-3, 4, (rows, n + 64)).to(torch.bfloat16)
        x = wide[:, 32:32 + n]  # a row stride that is not the width, and an offset start
        res = torch.randint(-3, 4, (rows, n)).to(torch.bfloat16)
        w = (torch.randint(-8, 9, (n,)) / 4).to(torch.bfloat16)
        eps = 1e-6
        r_ref = (x.float() + res.float()).to(torch.bfloat16)
        mean_sq = (r_ref.double() ** 2).sum(-1, keepdim=True).float() / n  # exact: integers below 2**24
        out_ref = ((r_ref.float() * (1.0 / torch.sqrt(mean_sq + eps))) * w.float()).to(torch.bfloat16)
        before = wide.clone()
        out = add_rms_norm_(x, res, w, eps)
        one_step = ((out.float() - out_ref.float()).abs() <= out_ref.float().abs() * 2.0 ** -7).all()
        if not (torch.equal(res, r_ref) and one_step and torch.equal(wide, before)):
            bad.append((n, rows))
print(bad or "ok")
"""


def test_one_pass_norm_reads_and_writes_the_right_elements(triton_interpreter):
    assert triton_interpreter("-c", _INTERPRETED, timeout=600).strip() == "ok"
