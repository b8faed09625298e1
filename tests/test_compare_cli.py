"""CPU pieces of compare/: the per-token table, argument errors, and the parity report logic."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from compare.direct_forward import parse_args
from compare.table import bf16_hex, f32_hex, format_rows
from spirl.parity import compare_logprobs

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
