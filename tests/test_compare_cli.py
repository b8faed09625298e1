"""CPU pieces of compare/: the per-token table, argument errors, and the parity report logic."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from compare.direct_forward import parse_args
from compare.table import bf16_hex, f32_hex, format_rows
from spirl.numerics.parity import compare_logprobs

ROOT = Path(__file__).resolve().parents[1]


def test_hex_columns_are_the_bit_patterns():
    assert f32_hex(-1.0) == "bf800000"
    assert bf16_hex(-1.0) == "bf80"
    assert f32_hex(0.0) != f32_hex(-0.0)


def test_table_marks_exactly_the_differing_rows():
    a = torch.tensor([-1.5, -2.25, -0.125])
    b = a.clone()
    b[1] = torch.nextafter(b[1], torch.tensor(0.0))  # one float32 ulp
    lines = format_rows([11, 22, 33], a, b, decode=lambda t: f"tok{t}")
    rows = lines[2:]
    assert len(rows) == 3 and "tok22" in rows[1]
    assert [("differs" in r) for r in rows] == [False, True, False]
    assert f32_hex(float(a[1])) in rows[1] and f32_hex(float(b[1])) in rows[1]


def test_parity_report_counts_and_first_mismatch():
    eng = [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0, -5.0])]
    same = compare_logprobs(eng, [t.clone() for t in eng])
    assert same.bitwise_identical and same.tokens_compared == 5 and "EXACT BITWISE MATCH" in same.summary()
    off = [eng[0].clone(), eng[1].clone()]
    off[1][2] = -5.0000005
    rep = compare_logprobs(eng, off)
    assert not rep.bitwise_identical and rep.tokens_different == 1 and rep.first_mismatch == (1, 2)
    assert "first mismatch: sequence 1, sampled token 2" in rep.summary()
    assert not compare_logprobs([torch.tensor([])], [torch.tensor([])]).bitwise_identical  # 0 compared


@pytest.mark.parametrize("argv,message", [
    (["--model", "m"], "one of the arguments --prompt --prompt-ids is required"),
    (["--model", "m", "--prompt", "x", "--samples", "0"], "--samples must be >= 1"),
    (["--model", "m", "--prompt", "x", "--temperature", "0"], "--temperature must be > 0"),
    (["--model", "m", "--prompt", "x", "--swap-op", "softmax"], "invalid choice"),
])
def test_direct_forward_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_run_comparison_sh_help_and_missing_prompt():
    ok = subprocess.run(["bash", str(ROOT / "run_comparison.sh"), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "EXACT BITWISE MATCH" in ok.stdout
    bad = subprocess.run(["bash", str(ROOT / "run_comparison.sh")], capture_output=True, text=True)
    assert bad.returncode == 2 and "error: no prompt given" in bad.stderr


@pytest.mark.parametrize("op", ["rms_norm", "rotary"])
def test_swapped_norm_or_rotary_reaches_the_models_fused_qk_step(op):
    """The model runs q/k RMSNorm + rotary as one backend op (qk_norm_rope): swapping either half
    for the reference must make that op use the reference half, not the base's fused kernel."""
    from compare.harness import SwappedOpBackend
    from torchtitan_compat.ops import ReferenceBackend

    class Base(ReferenceBackend):
        name = "base"

        def qk_norm_rope(self, *args):
            raise AssertionError("the base's fused op ran although one of its halves is swapped")

        def rms_norm(self, x, weight, eps):
            return super().rms_norm(x, weight, eps) + (0 if op == "rms_norm" else 1)  # marks the base's

        def rotary(self, positions, q, k, cache):
            q, k = super().rotary(positions, q, k, cache)
            return (q + 1, k + 1) if op == "rotary" else (q, k)

    swapped, ref = SwappedOpBackend(Base(), op), ReferenceBackend()
    pos = torch.tensor([0, 5, 2])
    q, k, w = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.ones(8)
    cache = ref.rope_cache(8, 16, 10000.0, torch.float32, "cpu")
    got = swapped.qk_norm_rope(pos, q, k, w, w, 1e-6, cache)
    base = Base()
    norm = ref.rms_norm if op == "rms_norm" else base.rms_norm
    rot = ref.rotary if op == "rotary" else base.rotary
    want = rot(pos, norm(q, w, 1e-6), norm(k, w, 1e-6), cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
