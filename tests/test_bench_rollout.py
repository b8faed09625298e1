"""compare/bench_rollout.py's host side (the engines themselves run on the GPU host): case parsing,
the slowdown against plain, the spread of repeated timings; and the sweep's (issue 39): a cell's timings
and Triton build counts, the engine facts read from vLLM's config, the worker's skip/stop loop, the
streamed worker output and its kill, and the parent's plan, resume, failure rows, report and plot, all
with fake engines speaking the worker's protocol."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_engine_names_pick_graph_mode_and_capture_sizes(tmp_path):
    from spirl.engines.vllm_engine import VLLMEngineConfig, compilation_kwargs, graph_sizes

    vllm_list = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))  # vLLM 0.26's default on an H100
    assert graph_sizes(512) == vllm_list and graph_sizes(100) == tuple(n for n in vllm_list if n <= 100)
    assert graph_sizes(2000) == vllm_list + (768, 1024, 1280, 1536, 1792) and graph_sizes() == graph_sizes(2048)
    assert VLLMEngineConfig("m").cuda_graph_sizes == graph_sizes()
    assert compilation_kwargs("full", (4, 1, 2))["compilation_config"] == {
        "mode": 0, "cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2, 4]}
    assert "cudagraph_capture_sizes" not in compilation_kwargs("full", None)["compilation_config"]
    assert compilation_kwargs("none", (1, 2)) == {"enforce_eager": True}
    capped = compilation_kwargs("full", graph_sizes(), max_num_seqs=2)["compilation_config"]  # run_comparison.sh
    assert capped["cudagraph_capture_sizes"] == [1, 2, 4]  # as vLLM caps its own list at 2 x max_num_seqs
    # above vLLM's own 512, only sizes up to max_model_len (vLLM 0.26 crashed capturing 768-2,048 at 96 and 256)
    short = compilation_kwargs("full", graph_sizes(), max_model_len=96)["compilation_config"]
    assert short["cudagraph_capture_sizes"] == list(graph_sizes(512))
    mid = compilation_kwargs("full", graph_sizes(), max_model_len=1100)["compilation_config"]
    assert mid["cudagraph_capture_sizes"] == list(graph_sizes(1024))
    assert compilation_kwargs("full", graph_sizes(), max_model_len=4096) == compilation_kwargs("full", graph_sizes())

    assert bench_rollout.engine_options("ours") == {"cuda_graphs": VLLMEngineConfig.cuda_graphs}
    assert bench_rollout.engine_options("ours:none") == {"cuda_graphs": "none"}
    assert bench_rollout.engine_options("ours@vllm") == {"cuda_graphs": VLLMEngineConfig.cuda_graphs,
                                                         "cuda_graph_sizes": None}
    assert bench_rollout.engine_options("ours:full_decode_only@1024") == {
        "cuda_graphs": "full_decode_only", "cuda_graph_sizes": graph_sizes(1024)}
    assert bench_rollout.engine_options("ours@1024+triton") == bench_rollout.engine_options("ours@1024")
    assert bench_rollout.worker_env("ours+triton")["SPIRL_GEMM_CUBLAS"] == "0"  # the Triton-only engine
    assert "SPIRL_GEMM_CUBLAS" not in bench_rollout.worker_env("ours") or os.environ.get("SPIRL_GEMM_CUBLAS")
    for bad in ("ourz", "ours:fast", "ours@", "ours@x512", "ours@0", "ours@-5", "ours@128x512", "ours+cublas",
                "plain+triton"):
        with pytest.raises(SystemExit, match="error: engine"):
            bench_rollout.engine_options(bad)
    with pytest.raises(SystemExit, match="ours:fast"):  # before any engine starts
        bench_rollout.main(["--model", str(tmp_path), "--engines", "ours:fast,plain", "--cases", "1x16x4"])


# -- the sweep (issue 39): every host-side path, with fake engines and recorded timings ---------------------

from types import SimpleNamespace  # noqa: E402

from compare import rollout_sweep as sw  # noqa: E402
from torchtitan_compat.config import hf_config_for_shape  # noqa: E402


def test_time_cell_warms_up_then_times_fresh_prompts_and_counts_triton_builds():
    calls, built = [], [0]

    def run(batch, prompt_len, new, seed):
        calls.append((batch, prompt_len, new, seed))
        if len(calls) == 1:
            built[0] += 3  # the warm-up compiles this prefill shape's kernels
        return {64: 0.5 + 0.1 * len(calls), 1: 0.05, 8: 0.1}[new]

    cell = sw.Cell(200, 16, 64)
    row = bench_rollout.time_cell(run, cell, 3, True, lambda: built[0])
    assert [c[2] for c in calls] == [8, 64, 64, 64, 1, 1, 1]  # warm-up, rollouts, prefills
    assert all(c[:2] == (200, 16) for c in calls) and len({c[3] for c in calls}) == 7  # fresh prompts every run
    assert row["seconds_each"] == [0.7, 0.8, 0.9] and row["seconds"] == 0.8 and row["tokens_per_s"] == 16000.0
    assert (row["warm_triton_builds"], row["timed_triton_builds"]) == (3, 0)
    assert row["prefill_seconds"] == 0.05 and row["prefill_each"] == [0.05] * 3
    again = []
    bench_rollout.time_cell(lambda *a: again.append(a) or 1.0, cell, 3, False, lambda: None)
    assert [a[3] for a in again] == [c[3] for c in calls[:4]]  # the other engine's process: the same prompts
    short = bench_rollout.time_cell(lambda *a: 1.0, sw.Cell(1, 16, 4), 1, False, lambda: None)
    assert short["warm_triton_builds"] is None and "prefill_seconds" not in short


def test_engine_facts_read_vllms_config_and_tolerate_its_absence():
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_capture_sizes=[8, 1, 4, 2],
                                                              cudagraph_mode="FULL_DECODE_ONLY"),
                          scheduler_config=SimpleNamespace(max_num_seqs=1024, max_num_batched_tokens=16384,
                                                           async_scheduling=True),
                          cache_config=SimpleNamespace(kv_cache_size_tokens=None, num_gpu_blocks=1000, block_size=16),
                          model_config=SimpleNamespace(enable_return_routed_experts=False), use_v2_model_runner=False)
    facts = bench_rollout.engine_facts(SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=cfg)))
    assert facts == {"capture_sizes": [1, 2, 4, 8], "cudagraph_mode": "FULL_DECODE_ONLY", "max_num_seqs": 1024,
                     "max_num_batched_tokens": 16384, "kv_tokens": 16000, "kv_block": 16, "returns_routes": False,
                     "async_scheduling": True, "v2_model_runner": False}  # False is a fact, not an absence
    cfg.cache_config.kv_cache_size_tokens = 15000
    assert bench_rollout.engine_facts(SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=cfg)))["kv_tokens"] == 15000
    assert bench_rollout.engine_facts(object()) == {"capture_sizes": [], "cudagraph_mode": "None", "max_num_seqs": None,
                                                    "max_num_batched_tokens": None, "kv_tokens": None, "kv_block": None,
                                                    "returns_routes": None, "async_scheduling": None,
                                                    "v2_model_runner": None}


def test_sweep_worker_loop_skips_stops_and_times():
    size = sw.ModelSize.from_config(hf_config_for_shape("Qwen3-1.7B"))
    now = [1000.0]

    def run(batch, prompt_len, new, seed):
        now[0] += 3.0  # every run 3 s: far slower than the estimate, so the deadline scales up
        return 3.0

    cells = [sw.Cell(1, 16, 64), sw.Cell(64, 8192, 64), sw.Cell(8, 16, 64), sw.Cell(16, 16, 64)]
    rows = []
    bench_rollout.sweep_cells(run, cells, {"kv_tokens": 100_000, "kv_block": 16}, size, sw.Deadline(at=1015.0), 2,
                              False, lambda: 0, rows.append, clock=lambda: now[0])
    kinds = [(r["kind"], r.get("batch")) for r in rows]
    # 1x16: 9 s, 24x its estimate. 64x8192 needs 528k KV tokens: skipped. 8x16 would end at 1009 + 24 x its
    # estimate (0.4 s) > 1015: stop.
    assert kinds == [("start", 1), ("cell", 1), ("skip", 64), ("stop", None)]
    assert rows[1]["seconds"] == 3.0 and "4 cells left" not in rows[3]["reason"] and "2 cells left" in rows[3]["reason"]


def test_stream_rows_reads_json_lines_as_they_come_and_kills_at_the_timeout():
    script = ("import json, sys, time\n"
              "print('INFO vLLM log line'); print(json.dumps({'kind': 'start', 'batch': 1}), flush=True)\n"
              "print('{not json'); print(json.dumps({'kind': 'cell', 'batch': 1}), flush=True)\n"
              "sys.stderr.write('a warning\\n'); sys.stderr.flush()\n"
              "time.sleep(float(sys.argv[1])); print(json.dumps({'kind': 'never'}))\n")
    got = []
    rc, err, killed = bench_rollout.stream_rows([sys.executable, "-c", script, "30"], dict(os.environ), got.append,
                                                timeout=3.0)
    assert killed and rc != 0 and [r["kind"] for r in got] == ["start", "cell"] and "a warning" in err
    got.clear()
    rc, err, killed = bench_rollout.stream_rows([sys.executable, "-c", script, "0"], dict(os.environ), got.append)
    assert (rc, killed, [r["kind"] for r in got]) == (0, False, ["start", "cell", "never"])


SECONDS = {"ours": {1: 0.30, 8: 0.33, 255: 1.40, 256: 1.00}, "plain": {1: 0.29, 8: 0.33, 255: 1.00, 256: 1.02}}
"""Recorded-style timings per engine and batch (x (1 + P / 1024) for the prompt): batch 255 is the miss."""


class FakeEngines:
    """run_sweep_engine's stand-in: speaks the worker's protocol (engine, start, cell, stop rows) with the
    timings above. `stop_after[name]`: the cells that engine measures before its budget stops it;
    `crash[name]`: a cell at which it dies (exit 1, after its start row)."""

    def __init__(self, stop_after=None, crash=None):
        self.stop_after, self.crash, self.given = stop_after or {}, crash or {}, []

    def __call__(self, name, args, cells, deadline, on_row):
        self.given.append((name, [str(c) for c in cells]))
        assert deadline > time.time()
        on_row({"kind": "engine", "engine_start_s": 30.0, "gpu": "fake", "capture_sizes": sw.capture_sizes(),
                "kv_tokens": 500_000, "kv_block": 16})
        for i, cell in enumerate(cells):
            if i == self.stop_after.get(name):
                on_row({"kind": "stop", "reason": f"budget: {len(cells) - i} cells left"})
                return 0, "", False
            on_row({"kind": "start", **bench_rollout.cell_fields(cell)})
            if str(cell) == self.crash.get(name):
                return 1, "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory", False
            s = SECONDS[name][cell.batch] * (1 + cell.prompt_len / 1024)
            on_row({"kind": "cell", **bench_rollout.cell_fields(cell), "seconds": s, "seconds_each": [s, s],
                    "tokens_per_s": cell.batch * cell.new_tokens / s})
        return 0, "", False


def _config_dir(d: Path, shape: str) -> Path:
    """A directory holding only the config.json of `shape` (what the sweep's planner reads)."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_config_for_shape(shape)))
    return d


@pytest.fixture
def model_dir(tmp_path):
    return _config_dir(tmp_path / "q17", "Qwen3-1.7B")


def _sweep_argv(model_dir, results, *extra):
    return ["--sweep", "--model", str(model_dir), "--results", str(results), "--grid-batches", "1,8,255,256",
            "--grid-prompts", "16,512", *extra]


def test_sweep_resumes_pairs_within_a_call_and_reports(monkeypatch, tmp_path, model_dir, capsys):
    results = tmp_path / "out" / "sweep.jsonl"
    fake = FakeEngines(stop_after={"ours": 5})
    monkeypatch.setattr(bench_rollout, "run_sweep_engine", fake)
    assert bench_rollout.main(_sweep_argv(model_dir, results)) == 0
    grid = ["1x16x64", "8x16x64", "1x512x64", "255x16x64", "8x512x64", "256x16x64", "255x512x64", "256x512x64"]
    assert fake.given == [("ours", grid), ("plain", grid[:5])]  # plain runs what ours measured
    out = capsys.readouterr().out
    assert "q17: ours / plain, 5 cells; worst 1.400x at batch 255 x prompt 16; 1 above 1.05x" in out
    rows = sw.load_rows([results])
    assert {r["kind"] for r in rows} == {"engine", "cell"} and len({r["run_id"] for r in rows}) == 1
    assert all(r["shape"] == "q17" and r["label"] == "" and r["model"] == str(model_dir) for r in rows)

    fake2 = FakeEngines()
    monkeypatch.setattr(bench_rollout, "run_sweep_engine", fake2)
    assert bench_rollout.main(_sweep_argv(model_dir, results)) == 0  # the same command again: the rest
    assert fake2.given == [("ours", grid[5:]), ("plain", grid[5:])]
    assert "8 cells; worst 1.400x" in capsys.readouterr().out
    fake3 = FakeEngines()
    monkeypatch.setattr(bench_rollout, "run_sweep_engine", fake3)
    assert bench_rollout.main(_sweep_argv(model_dir, results, "--label", "after")) == 0  # a new label starts over
    assert fake3.given[0] == ("ours", grid)
    monkeypatch.setattr(bench_rollout, "run_sweep_engine", None)  # nothing left: no engine starts
    assert bench_rollout.main(_sweep_argv(model_dir, results)) == 0
    assert "0 to do" in capsys.readouterr().out


def test_sweep_records_a_crashed_cell_and_skips_it_next_time(monkeypatch, tmp_path, model_dir, capsys):
    results = tmp_path / "sweep.jsonl"
    monkeypatch.setattr(bench_rollout, "run_sweep_engine", FakeEngines(crash={"plain": "255x16x64"}))
    assert bench_rollout.main(_sweep_argv(model_dir, results, "--grid-prompts", "16")) == 1
    out = capsys.readouterr().out
    assert "plain FAILED (exit 1: torch.OutOfMemoryError: CUDA out of memory)" in out
    assert "failed: plain q17 255x16x64" in out and "2 cells; worst" in out  # 1 and 8 were paired
    fake = FakeEngines()
    monkeypatch.setattr(bench_rollout, "run_sweep_engine", fake)
    assert bench_rollout.main(_sweep_argv(model_dir, results, "--grid-prompts", "16")) == 0
    assert fake.given[0] == ("ours", ["256x16x64"])  # 255 crashed an engine: not again ...
    monkeypatch.setattr(bench_rollout, "run_sweep_engine", fake := FakeEngines())
    assert bench_rollout.main(_sweep_argv(model_dir, results, "--grid-prompts", "16", "--retry-failed")) == 0
    assert fake.given[0] == ("ours", ["255x16x64"])  # ... unless asked


def test_plan_starts_nothing_and_plot_reads_merged_files(monkeypatch, tmp_path, model_dir, capsys):
    monkeypatch.setattr(bench_rollout, "run_sweep_engine", None)
    assert bench_rollout.main(_sweep_argv(model_dir, tmp_path / "none.jsonl", "--plan")) == 0
    out = capsys.readouterr().out
    assert "this call: 8 cells" in out and "  255x512x64 " in out
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    monkeypatch.setattr(bench_rollout, "run_sweep_engine", FakeEngines())
    assert bench_rollout.main(_sweep_argv(model_dir, a, "--grid-prompts", "16")) == 0
    assert bench_rollout.main(_sweep_argv(model_dir, b, "--grid-prompts", "512")) == 0
    capsys.readouterr()
    png = tmp_path / "docs" / "sweep.png"
    assert bench_rollout.main(["--plot", "--results", str(a), "--results", str(b), "--png", str(png), "--worst", "2"]) == 0
    out = capsys.readouterr().out
    assert "q17: ours / plain, 8 cells; worst 1.400x at batch 255 x prompt 16; 2 above 1.05x" in out
    if importlib.util.find_spec("matplotlib"):
        assert png.read_bytes()[:4] == b"\x89PNG" and f"heatmap: {png}" in out
    assert bench_rollout.main(["--plot", "--results", str(tmp_path / "none.jsonl")]) == 2


def test_sweep_arguments_are_one_line(tmp_path, model_dir):
    with pytest.raises(SystemExit, match="need --results"):
        bench_rollout.main(["--sweep", "--model", str(model_dir)])
    with pytest.raises(SystemExit, match="pick one"):
        bench_rollout.main(["--sweep", "--plot", "--results", "x"])
    with pytest.raises(SystemExit, match="compares engines with 'plain'"):
        bench_rollout.main(_sweep_argv(model_dir, tmp_path / "r", "--engines", "ours,ours:none"))
    with pytest.raises(SystemExit, match="--grid-batches"):
        bench_rollout.main(_sweep_argv(model_dir, tmp_path / "r", "--grid-batches", "0"))
    with pytest.raises(SystemExit, match="no config.json"):
        bench_rollout.main(_sweep_argv(tmp_path, tmp_path / "r", "--plan"))
    with pytest.raises(SystemExit, match="--budget-s"):
        bench_rollout.main(_sweep_argv(model_dir, tmp_path / "r", "--budget-s", "0"))


class FakeLLM:
    """vllm.LLM's surface the worker uses: generate() of exactly max_tokens tokens, and a config."""

    def __init__(self):
        self.calls = []
        cache = SimpleNamespace(kv_cache_size_tokens=20_000, num_gpu_blocks=None, block_size=16)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8], cudagraph_mode="FULL_DECODE_ONLY"),
            scheduler_config=SimpleNamespace(max_num_seqs=1024, max_num_batched_tokens=16384), cache_config=cache))

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(([len(p["prompt_token_ids"]) for p in prompts], params.max_tokens, params.min_tokens,
                           params.ignore_eos, tuple(p["prompt_token_ids"][0] for p in prompts)))
        token_ids = list(range(params.max_tokens))
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=token_ids)]) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    """The worker in this process, with vllm's SamplingParams/TokensPrompt and build_llm faked."""
    vllm = SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", SimpleNamespace(TokensPrompt=dict))
    llm = FakeLLM()
    monkeypatch.setattr(bench_rollout, "build_llm", lambda *a: llm)
    return llm


def test_worker_sweep_mode_speaks_the_protocol(fake_vllm, model_dir, capsys):
    argv = ["--worker", "plain", "--sweep", "--model", str(model_dir), "--cases", "2x16x4,4x8192x4,2x32x4",
            "--deadline", str(time.time() + 300), "--repeats", "2", "--split-prefill"]
    assert bench_rollout.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["kind"], r.get("batch"), r.get("prompt_len")) for r in rows] == [
        ("engine", None, None), ("start", 2, 16), ("cell", 2, 16), ("skip", 4, 8192), ("start", 2, 32), ("cell", 2, 32)]
    assert rows[0]["capture_sizes"] == [1, 2, 4, 8] and rows[0]["kv_tokens"] == 20_000 and rows[0]["gpu"] == "no GPU"
    assert "4 sequences of 8196 tokens do not fit 20000" in rows[3]["reason"]
    assert set(rows[2]) >= {"seconds", "seconds_each", "prefill_seconds", "warm_triton_builds", "tokens_per_s"}
    # the engine warm-up, then per cell: warm-up (4 new tokens), 2 rollouts, 2 prefills of one token
    assert [(c[0], c[1]) for c in fake_vllm.calls] == [([64] * 8, 16)] + [
        ([16, 16], 4), ([16, 16], 4), ([16, 16], 4), ([16, 16], 1), ([16, 16], 1),
        ([32, 32], 4), ([32, 32], 4), ([32, 32], 4), ([32, 32], 1), ([32, 32], 1)]
    assert all(c[1] == c[2] and c[3] for c in fake_vllm.calls)  # exactly max_tokens, ignore_eos
    firsts = [c[4] for c in fake_vllm.calls]
    assert len(set(firsts)) == len(firsts)  # fresh prompts every run


def test_worker_cases_mode_rows_feed_the_table(fake_vllm, model_dir, capsys):
    assert bench_rollout.main(["--worker", "ours", "--model", str(model_dir), "--cases", "8x512x16", "--repeats", "3"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["engine"] == "ours" and len(row["seconds_each"]) == 3 and row["tokens_per_s"] > 0
    assert "engine_start_s" in row and "kind" not in row
    with pytest.raises(SystemExit, match="needs --deadline"):
        bench_rollout.main(["--worker", "ours", "--sweep", "--model", str(model_dir), "--cases", "8x512x16"])


def test_the_parents_worker_command_parses_as_meant(model_dir, tmp_path):
    args = bench_rollout.parse_args(_sweep_argv(model_dir, tmp_path / "r.jsonl", "--split-prefill", "--repeats", "3"))
    cells = [sw.Cell(8, 16, 64), sw.Cell(255, 512, 64)]
    cmd = bench_rollout.worker_cmd("plain", args, ",".join(map(str, cells)),
                                   ["--sweep", "--deadline", "1234.5", "--split-prefill"])
    assert cmd[:2] == [sys.executable, bench_rollout.__file__]
    w = bench_rollout.parse_args(cmd[2:])
    assert (w.worker, w.sweep, w.deadline, w.split_prefill, w.repeats, w.model) == ("plain", True, 1234.5, True, 3,
                                                                                      str(model_dir))
    assert [sw.Cell(*c) for c in bench_rollout.parse_cases(w)] == cells


FAKE_VLLM = '''
"""A stand-in for vllm in a worker subprocess (tests/test_bench_rollout.py): LLM, SamplingParams, TokensPrompt."""
import time
from types import SimpleNamespace


class SamplingParams(SimpleNamespace):
    pass


class LLM:
    def __init__(self, model, **kw):
        cfg = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8],
                                                                 cudagraph_mode="NONE"),
                              scheduler_config=SimpleNamespace(max_num_seqs=1024, max_num_batched_tokens=16384),
                              cache_config=SimpleNamespace(kv_cache_size_tokens=None, num_gpu_blocks=64, block_size=16))
        self.llm_engine = SimpleNamespace(vllm_config=cfg)

    def generate(self, prompts, params, use_tqdm=False):
        time.sleep(0.01)  # a rollout takes time: its seconds round above 0 (the report divides by them)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * params.max_tokens)]) for _ in prompts]
'''


def test_a_real_worker_process_streams_its_rows(monkeypatch, tmp_path, model_dir):
    """The parent's command, environment and stream end to end, with vllm replaced by FAKE_VLLM."""
    _fake_vllm_site(monkeypatch, tmp_path)
    args = bench_rollout.parse_args(_sweep_argv(model_dir, tmp_path / "r.jsonl", "--repeats", "1"))
    rows = []
    rc, err, killed = bench_rollout.run_sweep_engine(
        "plain", args, [sw.Cell(2, 16, 4), sw.Cell(8, 512, 4)], time.time() + 120, rows.append)
    assert (rc, killed) == (0, False), err
    assert [(r["kind"], r.get("batch")) for r in rows] == [("engine", None), ("start", 2), ("cell", 2), ("skip", 8)]
    assert rows[0]["kv_tokens"] == 1024 and rows[0]["capture_sizes"] == [1, 2, 4, 8]  # 64 blocks of 16


# -- --paired: every engine at once, each cell's runs interleaved --------------------------------------------


def test_paired_cell_interleaves_the_engines_rotating_their_order():
    calls = []

    def counter(name):
        def counted(new, role, r):
            calls.append((name, role, r, new))
            return 1.0 + 0.1 * len(calls), 0
        return counted

    rows = bench_rollout.paired_cell({"a": counter("a"), "b": counter("b")}, sw.Cell(8, 16, 64), 3, True)
    assert [(n, role, r) for n, role, r, _ in calls] == [
        ("a", "warm", 0), ("b", "warm", 0),
        ("a", "rollout", 0), ("b", "rollout", 0), ("b", "rollout", 1), ("a", "rollout", 1),
        ("a", "rollout", 2), ("b", "rollout", 2),
        ("a", "prefill", 0), ("b", "prefill", 0), ("b", "prefill", 1), ("a", "prefill", 1),
        ("a", "prefill", 2), ("b", "prefill", 2)]
    assert {new for _, role, _, new in calls if role == "warm"} == {sw.WARMUP_NEW_TOKENS}
    # each engine's row holds its own runs, in repeat order: a ran 3rd, 6th, 7th; b 4th, 5th, 8th
    assert rows["a"]["seconds_each"] == [1.3, 1.6, 1.7] and rows["b"]["seconds_each"] == [1.4, 1.5, 1.8]
    assert rows["a"]["seconds"] == 1.6 and rows["a"]["warm_seconds"] == 1.1
    assert rows["b"]["prefill_each"] == [2.0, 2.1, 2.4]  # b's prefills ran 10th, 11th, 14th
    assert rows["a"]["timed_triton_builds"] == 0 and rows["a"]["batch"] == 8


def test_serve_answers_each_request_with_one_run_row():
    seeds, built = [], iter(range(0, 100, 2))
    emitted = []

    def run(batch, prompt_len, new, seed):
        seeds.append((batch, prompt_len, new, seed))
        return 0.25

    cell = sw.Cell(4, 32, 16)
    requests = [json.dumps({**bench_rollout.cell_fields(cell), "new": 16, "role": "rollout", "repeat": r}) + "\n"
                for r in (0, 1)]
    bench_rollout.serve(run, lambda: next(built), ["\n", *requests], emitted.append)
    assert emitted == [{"kind": "run", "seconds": 0.25, "builds": 2}] * 2
    assert seeds == [(4, 32, 16, bench_rollout.prompt_seed(cell, "rollout", r)) for r in (0, 1)]


def _fake_vllm_site(monkeypatch, tmp_path):
    fake = tmp_path / "fake_site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_VLLM)
    (fake / "inputs.py").write_text("TokensPrompt = dict\n")
    monkeypatch.setenv("PYTHONPATH", f"{fake.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


@pytest.mark.slow
def test_a_paired_sweep_runs_worker_processes_side_by_side(monkeypatch, tmp_path, model_dir, capsys):
    """Two real worker processes in the serve loop (both FAKE_VLLM's `plain` worker; the parent names one `ours`),
    each given half of the memory share; every cell measured by both, interleaved; a cell too big for the KV
    cache skipped by both."""
    _fake_vllm_site(monkeypatch, tmp_path)
    cmds = {}

    def cmd(name, args, n):
        cmds[name] = real(name, args, n)
        return real("plain", args, n)

    real = bench_rollout.paired_worker_cmd
    monkeypatch.setattr(bench_rollout, "paired_worker_cmd", cmd)
    plain_env = bench_rollout.worker_env("plain")
    monkeypatch.setattr(bench_rollout, "worker_env", lambda name: plain_env)  # a plain worker: plain's env
    results = tmp_path / "r.jsonl"
    argv = ["--sweep", "--paired", "--model", str(model_dir), "--results", str(results), "--grid-batches", "2,4",
            "--grid-prompts", "16,192", "--repeats", "2", "--label", "p", "--gpu-memory-utilization", "0.8"]
    assert bench_rollout.main(argv) == 0
    w = bench_rollout.parse_args(cmds["ours"][2:])
    assert (w.worker, w.serve, w.gpu_memory_utilization) == ("ours", True, 0.4)
    rows = sw.load_rows([str(results)])
    cells = [(r["engine"], r["kind"], r.get("batch"), r.get("prompt_len")) for r in rows]
    assert cells[:2] == [("ours", "engine", None, None), ("plain", "engine", None, None)]
    measured = [(e, "cell", b, p) for e in ("ours", "plain") for b, p in ((2, 16), (4, 16), (2, 192))]
    skipped = [(e, "skip", 4, 192) for e in ("ours", "plain")]  # 4 x 256 tokens: not within the fake's 1,024
    assert sorted(cells[2:]) == sorted(measured + skipped)
    assert all(r["paired"] and len(r["seconds_each"]) == 2 for r in rows if r["kind"] == "cell")
    assert "ours / plain, 3 cells" in capsys.readouterr().out


def test_a_paired_engine_that_dies_fails_the_call_in_one_line(monkeypatch, tmp_path, model_dir, capsys):
    monkeypatch.setattr(bench_rollout, "paired_worker_cmd", lambda name, args, n: [
        sys.executable, "-c", "import sys; sys.stderr.write('torch.OutOfMemoryError: CUDA out of memory\\n'); sys.exit(3)"])
    argv = ["--sweep", "--paired", "--model", str(model_dir), "--results", str(tmp_path / "r.jsonl"),
            "--grid-batches", "2", "--grid-prompts", "16"]
    assert bench_rollout.main(argv) == 1
    assert "FAILED: ours: exit 3: torch.OutOfMemoryError: CUDA out of memory" in capsys.readouterr().out


def _state(pid: int, want: str = "T", wait_s: float = 5.0) -> str:
    """A process's state letter from /proc (T: stopped), polled until it is `want` or `wait_s` passed (a signal is
    delivered asynchronously)."""
    end = time.time() + wait_s
    while True:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state == want or time.time() > end:
            return state
        time.sleep(0.01)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc (Linux)")
def test_a_served_engine_is_stopped_between_its_runs(monkeypatch, tmp_path, model_dir):
    _fake_vllm_site(monkeypatch, tmp_path)
    args = bench_rollout.parse_args(_sweep_argv(model_dir, tmp_path / "r.jsonl"))
    eng = bench_rollout.ServedEngine("plain", bench_rollout.paired_worker_cmd("plain", args, 2),
                                     bench_rollout.worker_env("plain"))
    try:
        assert eng.start(60)["kind"] == "engine"
        pid = eng._proc.pid
        assert _state(pid) == "T"
        seconds, _ = eng.run(sw.Cell(2, 16, 4), 4, "rollout", 0, 60)
        assert seconds > 0 and _state(pid) == "T"
    finally:
        eng.close()
    assert eng._proc.returncode == 0  # continued, its input closed: it ended on its own


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_served_worker_dies_with_its_parent(tmp_path):
    """A parent killed outright (SIGKILL: no `finally`) must not leave its stopped worker behind."""
    code = ("import subprocess, sys, time\n"
            "from compare import bench_rollout\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " preexec_fn=bench_rollout._die_with_parent)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(bench_rollout.__file__)))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root,
                              env={**os.environ, "PYTHONPATH": root})
    child = int(parent.stdout.readline())
    os.kill(child, signal.SIGSTOP)
    parent.kill()
    parent.wait()
    end = time.time() + 10
    while time.time() < end and os.path.exists(f"/proc/{child}") and _state(child, "Z", 0) != "Z":
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}") or _state(child, "Z", 0) == "Z"


def test_build_llm_refuses_a_process_whose_batch_invariant_mode_is_not_the_engines(monkeypatch):
    """vLLM reads VLLM_BATCH_INVARIANT at import: plain vLLM in a process with it set would run batch-invariant
    kernels and be timed as 'plain'. Refused before vLLM is touched."""
    from compare.bench_rollout import build_llm

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(SystemExit, match="engine 'plain' needs VLLM_BATCH_INVARIANT=0"):
        build_llm("plain", "/nonexistent", 0.8, 128)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    with pytest.raises(SystemExit, match="engine 'ours' needs VLLM_BATCH_INVARIANT=1"):
        build_llm("ours", "/nonexistent", 0.8, 128)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    with pytest.raises(SystemExit, match=r"needs VLLM_BATCH_INVARIANT=1 in this process \(it is unset\)"):
        build_llm("ours:full", "/nonexistent", 0.8, 128)


# -- Qwen3-MoE (issue 64): routes returned as training runs the engine, one engine on the GPU at a time ----------


@pytest.fixture(autouse=True)
def _no_gpu_memory_query(monkeypatch):
    """The plan's GPU memory is an H100's here whether or not this host has nvidia-smi (tests that want another
    set their own)."""
    monkeypatch.setattr(sw, "gpu_memory_bytes", lambda: None)


@pytest.fixture
def moe_dir(tmp_path):
    return _config_dir(tmp_path / "Qwen3-30B-A3B", "Qwen3-30B-A3B")


def test_the_engine_without_routes_is_named_and_built_without_them(monkeypatch):
    from spirl.engines.vllm_engine import VLLMEngineConfig

    assert bench_rollout.engine_options("ours-routes") == {"cuda_graphs": VLLMEngineConfig.cuda_graphs}
    assert bench_rollout.engine_options("ours:none@vllm-routes+triton")["cuda_graph_sizes"] is None
    assert [bench_rollout.returns_routes(n) for n in ("ours", "ours:full@1024+triton", "ours-routes",
                                                        "ours-routes+triton", "plain")] == [True, True, False, False,
                                                                                            False]
    for bad in ("ours-routes@1024", "ours+triton-routes", "plain-routes", "ours-route"):
        with pytest.raises(SystemExit, match="error: engine"):
            bench_rollout.engine_options(bad)
    assert bench_rollout.worker_env("ours-routes")["VLLM_BATCH_INVARIANT"] == "1"

    made = []

    class LLM:  # vllm.LLM's stand-in: records what it was asked for
        def __init__(self, model, **kw):
            made.append(kw)

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM))

    def engine():  # VLLMEngine's way: `from vllm import LLM` when it is built
        from vllm import LLM as built

        return built(model="m", enable_return_routed_experts=True, seed=0)

    bench_rollout.without_routes(engine)
    engine()
    assert made == [{"seed": 0}, {"enable_return_routed_experts": True, "seed": 0}]
    assert sys.modules["vllm"].LLM is LLM  # put back


def _routes(prompt_len, experts):
    """One sequence's routes as vLLM returns them, [prompt + new - 1, layers 2, k 2]: the prompt's rows all expert 0,
    then the decode steps' rows `experts` ([step][layer] -> (a, b))."""
    import numpy as np

    prompt = np.zeros((prompt_len, 2, 2), dtype=np.uint8)
    return np.concatenate([prompt, np.array(experts, dtype=np.uint8)])


def test_decode_experts_counts_distinct_experts_per_step_and_layer():
    import numpy as np

    a = _routes(3, [[(1, 2), (3, 4)], [(1, 2), (5, 6)]])
    b = _routes(3, [[(2, 7), (3, 4)], [(1, 2), (1, 2)]])
    # step 0: layer 0 {1, 2, 7} 3, layer 1 {3, 4} 2; step 1: layer 0 {1, 2} 2, layer 1 {5, 6, 1, 2} 4
    assert bench_rollout.decode_experts([a, b], 3) == (3 + 2 + 2 + 4) / 4
    assert bench_rollout.decode_experts([a], 3) == 2.0  # one sequence: its k experts
    assert bench_rollout.decode_experts([a[:3]], 3) is None  # one new token: no decode step
    out = [SimpleNamespace(outputs=[SimpleNamespace(routed_experts=r)]) for r in (a, b)]
    assert bench_rollout.route_facts(out, 3, True) == {"routes": True, "decode_experts": 2.75}
    bare = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1])])]
    assert bench_rollout.route_facts(bare, 3, False) == bench_rollout.route_facts(bare, 3, None) == {"routes": False}
    with pytest.raises(RuntimeError, match="returned no routes; expected routes"):
        bench_rollout.route_facts(bare, 3, True)  # SPIRL's engine not as training runs it
    with pytest.raises(RuntimeError, match="returned routes; expected none"):
        bench_rollout.route_facts(out, 3, False)
    with pytest.raises(RuntimeError, match="returned routes; expected none"):
        bench_rollout.route_facts(out, 3, None)
    assert np.asarray(a).dtype == np.uint8  # vLLM's dtype for 128 experts


class FakeMoELLM(FakeLLM):
    """FakeLLM that returns routes: experts (step + sequence) % 4 and 4 + that, in every layer (2 layers, k 2)."""

    def generate(self, prompts, params, use_tqdm):
        import numpy as np

        outs = super().generate(prompts, params, use_tqdm)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            rows = len(p["prompt_token_ids"]) + params.max_tokens - 1
            e = (np.arange(rows)[:, None, None] + i) % 4 + np.array([0, 4])[None, None, :]
            o.outputs[0].routed_experts = np.broadcast_to(e, (rows, 2, 2)).astype(np.uint8)
        return outs


def test_worker_on_a_moe_records_the_routes_and_refuses_an_engine_without_them(fake_vllm, monkeypatch, moe_dir,
                                                                                   capsys):
    llm = FakeMoELLM()
    monkeypatch.setattr(bench_rollout, "build_llm", lambda *a: llm)
    argv = ["--worker", "ours", "--sweep", "--model", str(moe_dir), "--cases", "2x16x4,1x16x4,2x16x1",
            "--deadline", str(time.time() + 300), "--repeats", "1"]
    assert bench_rollout.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["kind"] == "engine" and rows[0]["moe_tuned_config"].startswith("?")  # no vLLM here: said so
    cells = {(r["batch"], r["new_tokens"]): r for r in rows if r["kind"] == "cell"}
    # 2 sequences: steps differ by one, so each step's 4 slots hold 4 experts; 1 sequence: its 2
    assert cells[(2, 4)]["routes"] is True and cells[(2, 4)]["decode_experts"] == 4.0
    assert cells[(1, 4)]["decode_experts"] == 2.0
    assert cells[(2, 1)]["routes"] is True and "decode_experts" not in cells[(2, 1)]  # no decode step: no count
    with pytest.raises(RuntimeError, match="returned routes; expected none"):
        bench_rollout.main(["--worker", "plain", *argv[2:]])  # plain vLLM returning routes is not plain vLLM
    monkeypatch.setattr(bench_rollout, "build_llm", lambda *a: FakeLLM())
    with pytest.raises(RuntimeError, match="returned no routes; expected routes"):
        bench_rollout.main(argv)  # SPIRL's engine on a MoE must return them, as training runs it


def test_a_moe_sweep_runs_one_engine_at_a_time_and_records_the_call(monkeypatch, tmp_path, moe_dir, capsys):
    monkeypatch.setattr(sw, "gpu_memory_bytes", lambda: 143771 * 2**20)  # an H200
    results = tmp_path / "moe.jsonl"
    argv = ["--sweep", "--model", str(moe_dir), "--results", str(results), "--grid-batches", "1,8,64,256",
            "--grid-prompts", "16,512,4096", "--goal", "1.1"]
    with pytest.raises(SystemExit, match="leave no KV cache in 0.425 of 140.4 GiB: run without --paired"):
        bench_rollout.main([*argv, "--paired"])  # both engines' 56 GiB of weights do not fit at once
    with pytest.raises(SystemExit, match=r"raise --gpu-memory-utilization above 0\.4[0-9]"):
        bench_rollout.main([*argv, "--gpu-memory-utilization", "0.4"])
    assert bench_rollout.main([*argv, "--plan", "--budget-s", "340"]) == 0
    out = capsys.readouterr().out
    assert "this call: 10 cells" in out and "1 left for a later call; 1 do not fit the KV cache" in out
    assert "140.4 GiB of GPU memory" in out and "  64x512x64 " in out and "  64x4096x64 " not in out

    fake = FakeEngines()
    seen = {}

    def one_at_a_time(name, args, cells, deadline, on_row):
        seen[name] = (args.gpu_memory_utilization, deadline - time.time())
        return fake(name, args, cells, deadline, on_row)

    monkeypatch.setattr(bench_rollout, "run_sweep_engine", one_at_a_time)
    SECONDS["ours"][64], SECONDS["plain"][64] = 1.0, 1.0
    try:
        assert bench_rollout.main([*argv, "--budget-s", "400"]) == 0
    finally:
        del SECONDS["ours"][64], SECONDS["plain"][64]
    assert [n for n, _ in fake.given] == ["ours", "plain"]  # one after the other, each with all of the share
    assert seen["ours"][0] == seen["plain"][0] == 0.85
    assert seen["ours"][1] < 400 / 2  # plain's torch.compile start is left to it
    rows = sw.load_rows([results])
    engines = [r for r in rows if r["kind"] == "engine"]
    assert len(engines) == 2 and all(r["command"].startswith("python compare/bench_rollout.py --sweep --model ")
                                     for r in engines)
    assert all("commit" in r for r in engines) and not any("command" in r for r in rows if r["kind"] == "cell")
    assert "Qwen3-30B-A3B: ours / plain, 11 cells" in capsys.readouterr().out


def test_provenance_names_the_commit_and_the_command():
    got = bench_rollout.provenance(["--sweep", "--label", "a b"])
    assert got["command"] == "python compare/bench_rollout.py --sweep --label 'a b'"
    if got["commit"] is not None:  # a git checkout
        assert len(got["commit"].rstrip("+")) == 12
