"""compare/rollout_steps.py's pure parts: the cell list and one rollout's step summary."""

import pytest

from compare.rollout_steps import parse_cells, summarize


class Event:
    """A CUDA event's stand-in: a timestamp in ms, and elapsed_time to another."""

    def __init__(self, ms):
        self.ms = ms

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_parse_cells_reads_batch_x_prompt_and_refuses_anything_else():
    assert parse_cells("128x16,129x16") == [(128, 16), (129, 16)]
    for bad in ("", "128", "128x0", "axb", "1x2x3"):
        with pytest.raises(SystemExit, match="BATCHxPROMPT"):
            parse_cells(bad)


def test_summarize_splits_first_steps_from_the_median_of_the_rest():
    events = [("sched", 0.0, 2048), ("sched", 0.0, 128)]
    events += [("step", i, i + dt) for i, dt in enumerate([0.080, 0.010, 0.008, 0.007, 0.006, 0.009, 0.007])]
    events += [("exec", 0.0, 0.070), ("exec", 1.0, 1.002), ("exec", 2.0, 1.001 + 1.0)]
    events += [("sample", 0.0, 0.003)]
    s = summarize(events)
    assert s["steps"] == 7 and s["tokens_first"] == [2048, 128]
    assert s["step_ms_first"] == [80.0, 10.0, 8.0, 7.0]
    assert s["step_ms_median_rest"] == 7.0          # median of 6, 9, 7 ms
    assert s["step_ms_sum"] == 127.0
    assert s["exec_ms_first"] == [70.0, 2.0] and s["exec_ms_median"] == 2.0
    assert s["sample_ms_median"] == 3.0


def test_summarize_of_an_empty_log():
    s = summarize([])
    assert s["steps"] == 0 and s["step_ms_median_rest"] is None and s["exec_ms_median"] is None
    assert s["gpu_exec_ms_median"] is None and s["gc_collections"] == 0 and s["gc_ms_sum"] == 0


def test_summarize_gives_gpu_medians_without_the_prefill_and_sums_collections():
    """GPU times come from (start, end) CUDA events (stand-ins with elapsed_time here); the first model call, the
    prefill, is left out of the GPU median; each collection's host time is summed."""
    events = [("gpu_exec", Event(0.0), Event(40.0)), ("gpu_exec", Event(50.0), Event(55.0)),
              ("gpu_exec", Event(60.0), Event(66.0)), ("gpu_exec", Event(70.0), Event(77.0))]
    events += [("gpu_sample", Event(0.0), Event(9.0)), ("gpu_sample", Event(10.0), Event(11.0)),
               ("gpu_sample", Event(20.0), Event(22.0))]
    events += [("gc", 1.0, 1.004), ("gc", 2.0, 2.0005)]
    s = summarize(events)
    assert s["gpu_exec_ms_median"] == 6.0           # 5, 6, 7 ms; the 40 ms prefill left out
    assert s["gpu_sample_ms_median"] == 1.5         # 1, 2 ms
    assert s["gc_collections"] == 2 and s["gc_ms_sum"] == 4.5


def test_rollout_inputs_draws_fresh_prompts_and_exact_length_params(monkeypatch):
    """compare/bench_rollout.rollout_inputs (shared by the three rollout benchmarks), with stand-ins for vLLM's
    SamplingParams and TokensPrompt (vLLM is not installed on the CPU machines)."""
    import sys
    import types

    import torch

    from compare.bench_rollout import rollout_inputs
    from torchtitan_compat.tokenizer import NUM_BPE_TOKENS

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: kw
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    g = torch.Generator().manual_seed(0)
    prompts, params = rollout_inputs(3, 5, 7, g)
    again, _ = rollout_inputs(3, 5, 7, g)
    ids = [p["prompt_token_ids"] for p in prompts]
    assert len(ids) == 3 and all(len(i) == 5 and max(i) < NUM_BPE_TOKENS for i in ids)
    assert ids != [p["prompt_token_ids"] for p in again]  # the generator moves on: plain vLLM's prefix cache misses
    assert params == {"n": 1, "max_tokens": 7, "min_tokens": 7, "ignore_eos": True, "temperature": 1.0,
                      "logprobs": 0, "seed": 1}


def _cell_line(batch, prompt, seconds, gpu_sums, new=64):
    import json

    return json.dumps({"engine": "x", "batch": batch, "prompt": prompt, "new_tokens": new, "seconds_each": seconds,
                       "runs": [{"gpu_ms_sum": g} for g in gpu_sums]})


def test_summarize_sums_the_rollouts_gpu_time_prefill_included():
    events = [("gpu_exec", Event(0.0), Event(40.0)), ("gpu_exec", Event(50.0), Event(55.0)),
              ("gpu_sample", Event(0.0), Event(9.0)), ("gpu_sample", Event(10.0), Event(11.0))]
    assert summarize(events)["gpu_ms_sum"] == 55.0
    assert summarize([])["gpu_ms_sum"] == 0


def test_report_compares_cells_both_engines_ran_by_gpu_and_wall_time(tmp_path, capsys):
    from compare.rollout_steps import compare_cells, main, read_cells

    ours, plain = tmp_path / "ours.log", tmp_path / "plain.log"
    ours.write_text("INFO vLLM log line\n" + "\n".join([
        '{"engine": "ours", "start_s": 40.0}',
        _cell_line(320, 16, [1.0, 1.2, 1.1], [700.0, 720.0, 710.0]),
        _cell_line(8, 512, [0.5, 0.5, 0.5], [480.0, 500.0, 490.0]),
        _cell_line(1, 16, [0.1], [10.0])]) + "\n")
    plain.write_text("\n".join([
        _cell_line(320, 16, [0.6, 0.6, 0.7], [760.0, 750.0, 770.0]),
        _cell_line(8, 512, [0.5, 0.5, 0.5], [450.0, 455.0, 460.0])]) + "\n")
    rows = compare_cells(read_cells(str(ours)), read_cells(str(plain)))
    assert [(r["batch"], r["prompt"]) for r in rows] == [(8, 512), (320, 16)]   # only the cells both ran
    assert rows[0]["gpu_ratio"] == round(490 / 455, 3) and rows[0]["wall_ratio"] == 1.0
    assert rows[1]["gpu_ratio"] == round(710 / 760, 3) and rows[1]["wall_ratio"] == round(1.1 / 0.6, 3)
    assert main(["--report", str(ours), str(plain)]) == 0
    out = capsys.readouterr().out
    assert "2 cells; by GPU time worst 1.077x at 8 x 512, 1 above 1.05x; by wall time worst 1.833x" in out
    assert out.count("above\n") == 1


def test_report_refuses_rows_without_gpu_time_and_files_without_cells(tmp_path):
    import json

    from compare.rollout_steps import compare_cells, main, read_cells

    old = tmp_path / "old.log"
    old.write_text(json.dumps({"batch": 1, "prompt": 16, "new_tokens": 64, "seconds_each": [1.0],
                               "runs": [{"steps": 64}]}) + "\n")
    new = tmp_path / "new.log"
    new.write_text(_cell_line(1, 16, [1.0], [5.0]) + "\n")
    with pytest.raises(SystemExit, match="cell 1x16 of ours has no GPU time per rollout"):
        compare_cells(read_cells(str(old)), read_cells(str(new)))
    empty = tmp_path / "empty.log"
    empty.write_text("only log lines\n")
    with pytest.raises(SystemExit, match="no cell rows"):
        read_cells(str(empty))
    other = tmp_path / "other.log"
    other.write_text(_cell_line(2, 16, [1.0], [5.0]) + "\n")
    with pytest.raises(SystemExit, match="no cell in common"):
        main(["--report", str(new), str(other)])


def test_main_needs_model_and_cells_unless_reporting(capsys):
    from compare.rollout_steps import main

    with pytest.raises(SystemExit) as e:
        main(["--cells", "8x16"])
    assert e.value.code == 2 and "--model and --cells are required" in capsys.readouterr().err
