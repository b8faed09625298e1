"""compare/phase_table.py: per-phase medians after the warm-up steps, the step's share, peak memory, and
parity totals over every step, from simple_rl.py's metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from compare import phase_table


def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def step(n, rollout, step_s, compared=100, different=0, peak=10.0):
    return {"step": n, "time/rollout": rollout, "time/backward": 1.0, "time/step": step_s,
            "memory/peak_gib/rollout": peak, "parity/tokens_compared": compared, "parity/tokens_different": different}


def test_medians_skip_the_warm_up_and_parity_counts_every_step(tmp_path, capsys):
    run = write_run(tmp_path / "a", [{"step": 0, "eval/accuracy": 0.1}, step(1, 9.0, 12.0, peak=30.5),
                                     step(2, 3.0, 4.0), step(3, 5.0, 6.0, different=2), step(4, 4.0, 5.0),
                                     step(4, 4.5, 5.5)])  # a resumed run logs step 4 again: the last line wins
    s = phase_table.summarize(phase_table.read_steps(run / "metrics.jsonl"), skip=1)
    assert s["steps"] == [2, 3, 4]
    assert s["median"]["rollout"] == 4.5 and s["median"]["step"] == 5.5
    assert s["peak_gib"] == 30.5
    assert (s["compared"], s["different"]) == (400, 2)
    assert phase_table.main([str(run), str(run / "metrics.jsonl")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["phase", "a", "a"]
    rollout = next(line for line in out if line.startswith("rollout"))
    assert "4.50 s ( 82%)" in rollout  # 4.5 / 5.5
    assert any(line.startswith("parity") and "2/400 diff" in line for line in out)


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="does not exist"):
        phase_table.main([str(tmp_path / "nope")])
    run = write_run(tmp_path / "b", [step(1, 1.0, 2.0)])
    with pytest.raises(SystemExit, match="nothing left to time"):
        phase_table.main([str(run), "--skip", "1"])
    (run / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(SystemExit, match="is not JSON"):
        phase_table.main([str(run)])


def test_a_run_that_logs_only_the_step_time_still_gets_a_table(tmp_path, capsys):
    run = write_run(tmp_path / "c", [{"step": 1, "time/step": 2.0}, {"step": 2, "time/step": 3.0}])
    assert phase_table.main([str(run)]) == 0
    assert any(line.startswith("step") and "3.00 s" in line for line in capsys.readouterr().out.splitlines())
