"""compare/experiment.py's table (the GPU runs of "your own experiment"): per-run phases, ratios to the default
loss, parity totals and each run's own dynamic-sampling counts, read from simple_rl.py's metrics.jsonl."""

from __future__ import annotations

import json

from compare import experiment


def _write(root, name, steps):
    d = root / "runs" / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, **m}) + "\n" for i, m in enumerate(steps)))


def _step(step_s, dyn=None):
    m = {"time/rollout": step_s / 2, "time/forward": 1.0, "time/backward": 2.0, "time/optimizer": 0.5,
         "time/step": step_s, "parity/tokens_compared": 100, "parity/tokens_different": 0, "reward_mean": 0.25}
    if dyn:
        m.update({"dynamic/rounds": 1, "dynamic/groups_sampled": dyn[0], "dynamic/groups_dropped": dyn[1],
                  "dynamic/groups_kept": dyn[2], "dynamic/round_limit": dyn[3]})
    return m


def test_table_reads_each_run_by_itself(tmp_path, capsys):
    _write(tmp_path, "ds-grpo", [_step(9.0), _step(4.0), _step(4.0)])
    _write(tmp_path, "ds-dapo-dyn", [_step(9.0, (4, 2, 2, 0)), _step(6.0, (6, 5, 1, 1)), _step(6.0, (2, 0, 2, 0))])
    _write(tmp_path, "rg-dapo-dyn", [_step(9.0, (8, 8, 0, 1))] * 3)
    assert experiment.main(["--out", str(tmp_path), "--runs", "none"]) == 0
    out = capsys.readouterr().out
    step = next(line for line in out.splitlines() if line.startswith("step "))
    assert step.split()[1:] == ["4.00", "(1.00x)", "6.00", "(1.50x)", "9.00", "(2.25x)"]  # medians of steps 2..
    groups = next(line for line in out.splitlines() if line.startswith("groups sampled"))
    assert groups.split()[-3:] == ["-", "12/7/5", "24/24/0"]
    limit = next(line for line in out.splitlines() if line.startswith("steps at the round limit"))
    assert limit.split()[-3:] == ["-", "1", "3"]
    assert "0/300" in out


def test_a_token_that_differs_fails_the_table(tmp_path, capsys):
    _write(tmp_path, "ds-grpo", [_step(4.0), {**_step(4.0), "parity/tokens_different": 1}])
    assert experiment.main(["--out", str(tmp_path), "--runs", "none"]) == 1
