"""compare/rollout_steps.py's pure parts: the cell list and one rollout's step summary."""

import pytest

from compare.rollout_steps import parse_cells, summarize


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
    class Event:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return end.ms - self.ms

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
