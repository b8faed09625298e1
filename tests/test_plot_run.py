"""compare/plot_run.py on CPU: loading (dedup, sort, TensorBoard fallback), the summary, the PNG, errors.

The synthetic run: a baseline eval on its own step-0 line, 20 steps, an eval every 5 steps merged
into that step's line, and a resume after step 10 that logs steps 11 and 12 again (after a cut-off
line), with different values, so only the later lines may count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compare import plot_run

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 20
ACCURACY = {0: 0.10, 5: 0.20, 10: 0.30, 15: 0.50, 20: 0.40}  # fractions, as logged


def _train_row(step: int, *, stale: bool = False) -> dict:
    row = {"step": step, "reward_mean": 0.1 * step, "reward_std": 0.2, "loss": 0.01, "entropy": 1.5 - 0.01 * step,
           "kl_div": 1e-3 * step, "parity/tokens_compared": 999 if stale else 100,
           "parity/tokens_different": 7 if stale else 0}
    if step in ACCURACY:
        row.update({"eval/accuracy": ACCURACY[step], "eval/pass@4": ACCURACY[step] + 0.1})
    return row


def _write_run(run: Path, *, with_kl: bool = True) -> Path:
    run.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": ACCURACY[0], "eval/pass@4": ACCURACY[0] + 0.1}]
    rows += [_train_row(s, stale=s > 10) for s in range(1, 13)]  # the interrupted run, past its checkpoint at 10
    rows += [_train_row(s) for s in range(11, STEPS + 1)]        # the resumed run logs 11 and 12 again
    if not with_kl:
        for row in rows:
            row.pop("kl_div", None)
    lines = [json.dumps(r) for r in rows]
    lines.insert(13, lines[13][:25])  # a cut-off line where the interrupted run stopped
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    meta = {"args": {"model": "Qwen/Qwen3-1.7B", "steps": STEPS}, "gpu": "NVIDIA H100 80GB HBM3"}
    (run / "run_metadata.json").write_text(json.dumps(meta))
    return run


def test_load_run_keeps_last_line_per_step_sorted(tmp_path):
    series = plot_run.load_run(_write_run(tmp_path / "run"))
    assert [s for s, _ in series["reward_mean"]] == list(range(1, STEPS + 1))
    assert series["eval/accuracy"] == [(s, v) for s, v in sorted(ACCURACY.items())]
    assert [s for s, _ in series["eval/pass@4"]] == sorted(ACCURACY)
    assert dict(series["parity/tokens_compared"])[11] == 100  # the resumed line, not the stale 999
    assert all(v == 0 for _, v in series["parity/tokens_different"])
    assert "step" not in series


def test_summary_numbers(tmp_path):
    s = plot_run.summary(plot_run.load_run(_write_run(tmp_path / "run")))
    assert s["first_eval_accuracy"] == pytest.approx(10.0)
    assert s["best_last3_eval_accuracy"] == pytest.approx(50.0)  # of 30, 50, 40
    assert s["evals"] == 5
    assert s["steps"] == STEPS and s["last_step"] == STEPS  # the step-0 baseline eval is not a step
    assert s["parity_tokens_compared"] == 100 * STEPS
    assert s["parity_tokens_different"] == 0


def test_summary_without_evals():
    s = plot_run.summary({"reward_mean": [(1, 0.5), (2, 0.7)]})
    assert s["first_eval_accuracy"] is None and s["best_last3_eval_accuracy"] is None
    assert s["steps"] == 2 and s["parity_tokens_compared"] == 0
    assert "no evals" in plot_run.summary_line("r", s)


def test_helpers():
    assert plot_run.rolling_mean([1.0, 3.0, 5.0], window=2) == [1.0, 2.0, 4.0]
    assert plot_run.as_percent([(0, 0.25)]) == [(0, 25.0)]
    assert plot_run.as_percent([(0, 25.0)]) == [(0, 25.0)]  # already percent
    assert plot_run.pass_at_keys({"eval/pass@16": [], "eval/pass@4": [], "eval/accuracy": []}) == \
        ["eval/pass@4", "eval/pass@16"]
    meta = {"config": {"model": "m"}, "gpu": "g"}
    assert plot_run.figure_title("run", meta) == "run | m | g"
    assert plot_run.figure_title("run", {"gpu": None}) == "run"


@pytest.mark.parametrize("with_kl", [True, False], ids=["kl", "no-kl"])
def test_main_writes_png_and_summary(tmp_path, capsys, with_kl):
    run = _write_run(tmp_path / "run", with_kl=with_kl)
    assert plot_run.main([str(run)]) == 0
    png = run / "curve.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == PNG_MAGIC
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) == 1
    assert "20 steps" in out and "10.0% first" in out and "50.0% best" in out
    assert "2000 tokens compared, 0 different" in out


def test_main_out_option(tmp_path, capsys):
    run = _write_run(tmp_path / "run")
    out_png = tmp_path / "plots" / "x.png"
    assert plot_run.main([str(run), "--out", str(out_png)]) == 0
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    assert not (run / "curve.png").exists()


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_bad_input_exits_2_with_one_stderr_line(tmp_path, capsys, make):
    run = tmp_path / "run"
    if make == "empty":
        run.mkdir()
    assert plot_run.main([str(run)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "error" in err


def test_script_runs_standalone_on_missing_dir(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "compare" / "plot_run.py"), str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1


def test_tensorboard_fallback(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "tbrun"
    writer = SummaryWriter(log_dir=str(run))
    writer.add_scalar("eval/accuracy", ACCURACY[0], 0)
    for step in range(1, 11):
        for key, value in _train_row(step).items():
            if key != "step":
                writer.add_scalar(key, value, step)
    writer.close()
    assert not (run / "metrics.jsonl").exists()
    series = plot_run.load_run(run)
    assert [s for s, _ in series["reward_mean"]] == list(range(1, 11))
    assert series["reward_mean"][-1][1] == pytest.approx(1.0)
    assert [s for s, _ in series["eval/accuracy"]] == [0, 5, 10]
    s = plot_run.summary(series)
    assert s["steps"] == 10 and s["parity_tokens_compared"] == 1000 and s["parity_tokens_different"] == 0
    assert s["first_eval_accuracy"] == pytest.approx(10.0)
    assert plot_run.main([str(run)]) == 0
    assert (run / "curve.png").read_bytes()[:8] == PNG_MAGIC
