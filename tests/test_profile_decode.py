"""compare/profile_decode.py's CPU parts: its --json rows read back, and --report's per-cell kernel-time ratios."""

import json

import pytest

from compare.profile_decode import compare_rows, main, read_rows


def _row(engine, batch, prompt, phase, ms, new=64):
    return json.dumps({"engine": engine, "batch": batch, "prompt": prompt, "new_tokens": new, "phase": phase,
                       "generated": 1 if phase == "prefill" else new, "kernel_ms": ms, "wall_ms": 10 * ms,
                       "top": [["some_kernel", ms / 2, 3]]})


def test_report_puts_the_engines_rollout_and_decode_kernel_time_side_by_side(tmp_path, capsys):
    ours, plain = tmp_path / "ours.jsonl", tmp_path / "plain.jsonl"
    ours.write_text("\n".join([
        _row("ours", 8, 128, "prefill", 5.0), _row("ours", 8, 128, "rollout", 150.0),
        _row("ours", 64, 16, "prefill", 9.0), _row("ours", 64, 16, "rollout", 100.0),
        _row("ours", 1, 16, "rollout", 40.0)]) + "\n")           # plain has no 1 x 16: left out
    plain.write_text("\n".join([
        _row("plain", 64, 16, "prefill", 10.0), _row("plain", 64, 16, "rollout", 110.0),
        _row("plain", 8, 128, "prefill", 6.0), _row("plain", 8, 128, "rollout", 120.0),
        _row("plain", 8, 128, "rollout", 140.0)]) + "\n")        # a later line replaces an earlier one
    rows = compare_rows(read_rows(str(ours)), read_rows(str(plain)))
    assert [(r["batch"], r["prompt"]) for r in rows] == [(8, 128), (64, 16)]
    assert rows[0]["rollout_ms"] == [150.0, 140.0] and rows[0]["ratio"] == round(150 / 140, 3)
    assert rows[0]["decode_ms"] == [145.0, 134.0] and rows[0]["decode_ratio"] == round(145 / 134, 3)
    assert rows[1]["ratio"] == round(100 / 110, 3) and rows[1]["decode_ratio"] == round(91 / 100, 3)
    assert main(["--report", str(ours), str(plain)]) == 0
    out = capsys.readouterr().out
    assert "2 cells; rollout kernel time worst 1.071x at 8 x 128, 1 above 1.05x" in out
    assert out.count("above\n") == 1


def test_report_without_prefill_rows_still_compares_the_rollouts(tmp_path, capsys):
    ours, plain = tmp_path / "o.jsonl", tmp_path / "p.jsonl"
    ours.write_text(_row("ours", 8, 16, "rollout", 100.0) + "\n")
    plain.write_text(_row("plain", 8, 16, "rollout", 100.0) + "\n")
    (row,) = compare_rows(read_rows(str(ours)), read_rows(str(plain)))
    assert row["ratio"] == 1.0 and "decode_ms" not in row
    assert main(["--report", str(ours), str(plain)]) == 0
    assert "0 above 1.05x" in capsys.readouterr().out


def test_report_refuses_what_is_not_its_rows(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(_row("ours", 8, 16, "rollout", 100.0) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"batch": 1}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: not a row of profile_decode.py --json"):
        read_rows(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no rows"):
        read_rows(str(empty))
    with pytest.raises(SystemExit, match="missing.jsonl: No such file"):
        read_rows(str(tmp_path / "missing.jsonl"))
    other = tmp_path / "other.jsonl"
    other.write_text(_row("plain", 2, 16, "rollout", 100.0) + "\n")
    with pytest.raises(SystemExit, match="no profiled rollout in common"):
        main(["--report", str(good), str(other)])


def test_main_needs_a_model_and_positive_sizes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--batches", "8"])
    assert e.value.code == 2 and "--model is required" in capsys.readouterr().err
    for argv, msg in ((["--model", "m", "--prompt-len", "16,x"], "--prompt-len '16,x': expected positive integers"),
                      (["--model", "m", "--batches", "0,8"], "--batches '0,8': expected positive integers")):
        with pytest.raises(SystemExit, match=msg):
            main(argv)
