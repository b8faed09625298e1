"""compare/bench_rollout.py's host side (the engines themselves run on the GPU host): case parsing,
the slowdown against plain, and the spread of repeated timings."""

from __future__ import annotations

import json

import pytest

from compare import bench_rollout


def test_table_slowdown_and_spread(monkeypatch, tmp_path, capsys):
    def fake_engine(name, args):
        assert args.repeats == 3
        secs = {"ours": [1.1, 1.0, 1.3], "plain": [0.5, 0.5, 0.5]}[name]
        return [{"engine": name, "batch": 8, "prompt_len": 512, "new_tokens": 256, "seconds": sorted(secs)[1],
                 "seconds_each": secs, "tokens_per_s": round(2048 / sorted(secs)[1], 1), "engine_start_s": 30.0}]
    monkeypatch.setattr(bench_rollout, "run_engine", fake_engine)
    out_json = tmp_path / "r.json"
    assert bench_rollout.main(["--model", str(tmp_path), "--cases", "8x512x256", "--repeats", "3",
                               "--json", str(out_json)]) == 0
    lines = capsys.readouterr().out.splitlines()
    ours = next(line for line in lines if line.startswith("ours"))
    assert "2.200x" in ours  # plain 4096 tok/s / ours (median 1.1 s) 1861.8 tok/s
    assert ours.endswith("27.3%")  # (1.3 - 1.0) / 1.1
    assert next(line for line in lines if line.startswith("plain")).endswith("0.0%")
    assert json.loads(out_json.read_text())["rows"][0]["slowdown_vs_plain"] == 2.2


def test_bad_arguments_are_one_line(tmp_path):
    with pytest.raises(SystemExit, match="--repeats 0"):
        bench_rollout.main(["--model", str(tmp_path), "--repeats", "0"])
    with pytest.raises(SystemExit, match="expected BATCHxPROMPTxNEW"):
        bench_rollout.main(["--model", str(tmp_path), "--cases", "8x512"])  # before any engine starts
    with pytest.raises(SystemExit, match="expected BATCHxPROMPTxNEW"):
        bench_rollout.main(["--model", str(tmp_path), "--cases", "8x0x256"])
