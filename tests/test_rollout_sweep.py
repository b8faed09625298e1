"""compare/rollout_sweep.py on the CPU with recorded timings: the grid and vLLM 0.26's capture sizes, the
time estimate against the measured steps it was read from, the plan within a budget, the results file
(cut-off lines, calls never mixed, resume), the report's worst cells and misses, and the heatmap PNG."""

from __future__ import annotations

import json

import pytest

from compare import rollout_sweep as sw
from torchtitan_compat.config import hf_config_for_shape

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SIZE_17 = sw.ModelSize.from_config(hf_config_for_shape("Qwen3-1.7B"))
SIZE_8 = sw.ModelSize.from_config(hf_config_for_shape("Qwen3-8B"))


def test_capture_sizes_are_vllm_026s_default_rule():
    sizes = sw.capture_sizes()  # an H100's defaults: max_num_seqs 1024, max_num_batched_tokens 16384
    assert len(sizes) == 51  # docs/cold-start.md: "CUDA graphs (51 sizes)"
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512]
    assert 248 in sizes and 252 not in sizes and 264 not in sizes and 272 in sizes
    assert sw.capture_sizes(max_num_seqs=4) == [1, 2, 4, 8]  # top = 2 * max_num_seqs
    assert sw.capture_sizes(max_num_batched_tokens=100) == [1, 2, 4, *range(8, 97, 8), 100]  # the token limit added
    odd = sw.odd_sizes(sizes)
    assert odd[:4] == [3, 5, 9, 17] and 257 in odd and 497 in odd and not set(odd) & set(sizes)
    assert len(odd) == 49  # every gap but 1->2 (no size between)


def test_parse_batches_and_prompts():
    assert sw.parse_batches("default") == sorted(sw.DEFAULT_BATCHES)
    assert sw.parse_batches("1-4,8") == [1, 2, 3, 4, 8]
    assert sw.parse_batches("capture,3") == sorted({*sw.capture_sizes(), 3})
    assert len(sw.parse_batches("capture,odd")) == 100
    assert sw.parse_batches("1-512") == list(range(1, 513))
    assert sw.parse_ints("8192,16,16", "--grid-prompts") == [16, 8192]
    for bad in ("0", "x", "4-2", "capture2", ""):
        with pytest.raises(SystemExit, match="--grid-batches .*default, capture, odd"):
            sw.parse_batches(bad)


def test_grid_order_and_cells():
    cells = sw.grid([1, 512, 8], [16, 8192], 64)
    assert [str(c) for c in cells] == ["1x16x64", "8x16x64", "1x8192x64", "512x16x64", "8x8192x64", "512x8192x64"]  # B * P, then B
    assert sw.Cell.of({"batch": 3, "prompt_len": 5, "new_tokens": 7}) == sw.Cell(3, 5, 7) and str(sw.Cell(3, 5, 7)) == "3x5x7"
    odd = [b for b in sw.DEFAULT_BATCHES if b not in sw.capture_sizes()]
    assert odd == [3, 65, 129, 255, 257]  # what DEFAULT_BATCHES' docstring says


@pytest.mark.parametrize("size,batch,derived_ms", [
    (SIZE_17, 1, 2.8), (SIZE_17, 64, 4.7), (SIZE_17, 256, 10.3),   # 6396e11:docs/rollout-profile.md, fifth run
    (SIZE_8, 1, 7.3), (SIZE_8, 64, 9.8), (SIZE_8, 256, 19.0),
])
def test_decode_step_estimate_is_on_the_slow_side_of_the_measured_rollouts(size, batch, derived_ms):
    """The numbers in Rates' docstring: the step time derived from a measured rollout's tok/s less its
    prefill, at 512 prompt + 256 new tokens (mean context 640); the estimate may be up to 25 % slower."""
    est = sw.decode_step_seconds(size, sw.Rates(), batch, 640) * 1e3
    assert derived_ms <= est <= 1.25 * derived_ms


def test_model_size_and_prefill_estimate():
    assert SIZE_17.layer_params == 28 * (2048 * 4096 + 2048 * 2048 + 3 * 2048 * 6144)
    assert abs(SIZE_8.decode_weight_bytes / 1e9 - 15.14) < 0.01
    assert SIZE_17.kv_bytes_per_token == 114688
    # 1.7B: 131k prompt tokens took 952 ms in the first profile (before the persistent GEMM)
    assert 0.6 < sw.prefill_seconds(SIZE_17, sw.Rates(), 256, 512) < 1.0


def test_plan_keeps_the_budget_and_order():
    rates = sw.Rates()
    cells = sw.grid(list(sw.DEFAULT_BATCHES), list(sw.DEFAULT_PROMPTS), 64)
    kv = sw.kv_tokens_estimate(SIZE_8, rates, 0.85)
    pl = sw.plan(cells, SIZE_8, rates, 540, 2, 2, False, kv, write_checkpoint=True)
    cost = lambda c: 2 * sw.cell_seconds(SIZE_8, rates, c, 2, False)
    assert pl.fixed_s + pl.cells_s <= 540
    assert abs(pl.cells_s - sum(map(cost, pl.cells))) < 1e-6
    assert [c for c in cells if c in set(pl.cells)] == pl.cells  # the grid's order
    assert all(not sw.fits_kv(c, kv) for c in pl.no_kv) and all(sw.fits_kv(c, kv) for c in pl.cells)
    assert len(pl.cells) + len(pl.over_budget) + len(pl.no_kv) == len(cells)
    first_left = pl.over_budget[0]
    assert pl.fixed_s + sum(cost(c) for c in pl.cells if cells.index(c) < cells.index(first_left)) + cost(first_left) > 540
    # a cheap cell after an expensive one that does not fit is still taken
    big, small = sw.Cell(512, 512, 64), sw.Cell(1, 16, 64)
    tight = sw.plan([big, small], SIZE_8, rates, sw.plan([], SIZE_8, rates, 1e9, 2, 2, False, None).fixed_s
                    + 2 * sw.cell_seconds(SIZE_8, rates, small, 2, False) + 1, 2, 2, False, None)
    assert tight.cells == [small] and tight.over_budget == [big]
    # the numbers 6396e11:docs/rollout-profile.md states for the default grid
    pl17 = sw.plan(cells, SIZE_17, rates, 540, 2, 2, False, sw.kv_tokens_estimate(SIZE_17, rates, 0.85), True)
    assert (len(pl17.cells), len(pl17.over_budget), len(pl17.no_kv)) == (96, 1, 23)
    assert (len(pl.cells), len(pl.over_budget), len(pl.no_kv)) == (67, 26, 27)


def test_kv_fit_and_deadline():
    assert sw.fits_kv(sw.Cell(64, 8192, 64), None)  # unknown capacity: assumed to fit (the worker knows it)
    need = 64 * 8256  # 8192 + 64 is a whole number of 16-token blocks
    assert sw.fits_kv(sw.Cell(64, 8192, 64), int(need / sw.KV_MARGIN) + 1)
    assert not sw.fits_kv(sw.Cell(64, 8192, 64), int(need / sw.KV_MARGIN) - 16)
    assert sw.fits_kv(sw.Cell(1, 1, 1), 17) and not sw.fits_kv(sw.Cell(1, 16, 1), 17)  # one block, then two
    d = sw.Deadline(at=100.0)
    assert d.allows(90.0, 10.0) and not d.allows(90.1, 10.0)
    d.record(measured_s=6.0, estimate_s=2.0)  # 3x slower than estimated: later estimates are tripled
    d.record(measured_s=1.0, estimate_s=2.0)  # a faster cell does not lower it
    assert d.scale == 3.0 and d.allows(70.0, 10.0) and not d.allows(70.1, 10.0)


def _row(kind="cell", engine="ours", run="r1", b=8, p=16, g=64, s=1.0, label="", shape="Qwen3-1.7B", **kw):
    return {"kind": kind, "engine": engine, "run_id": run, "label": label, "shape": shape, "batch": b,
            "prompt_len": p, "new_tokens": g, "seconds": s, "seconds_each": [s, s * 1.1], **kw}


def test_results_file_append_load_and_cut_off_lines(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    sw.append_rows(path, [_row(), _row(engine="plain")])
    with path.open("a") as f:
        f.write('{"kind": "cell", "engine": "ou')  # a call killed mid-line
    sw.append_rows(path, [_row(b=9)])             # the next call's first row gets a line of its own
    with path.open("a") as f:
        f.write('{"kind": "cell", "engine": "ours"}\n\n[1, 2]\n{"no": "kind"}\n')  # valid JSON, not a row
    rows = sw.load_rows([path, tmp_path / "absent.jsonl"])
    assert [(r["engine"], r["batch"]) for r in rows] == [("ours", 8), ("plain", 8), ("ours", 9)]
    assert len(path.read_text().splitlines()) == 8


def test_pairs_take_one_call_never_two():
    rows = [
        {"kind": "engine", "engine": "ours", "run_id": "r1", "capture_sizes": [1, 2, 4, 8]},
        _row(run="r1", b=8, s=1.2), _row(engine="plain", run="r1", b=8, s=1.0),     # r1: ratio 1.2
        _row(run="r1", b=3, s=2.0),                                                  # ours only in r1 ...
        _row(engine="plain", run="r2", b=3, s=1.0),                                  # ... plain only in r2
        _row(run="r3", b=8, s=1.1), _row(engine="plain", run="r3", b=8, s=1.0),     # r3, later: ratio 1.1
        _row(run="r1", b=8, label="after", s=0.9), _row(engine="plain", run="r1", b=8, label="after", s=1.0),
    ]
    got = {(p.label, p.cell.batch): p for p in sw.pairs(rows)}
    assert set(got) == {("", 8), ("after", 8)}  # batch 3 was never measured by both in one call
    assert got[("", 8)].rollout_ratio == pytest.approx(1.1) and got[("", 8)].ours["run_id"] == "r3"
    assert got[("after", 8)].rollout_ratio == pytest.approx(0.9)
    assert got[("after", 8)].captured is True and sw.pairs(rows[1:])[0].captured is None
    assert sw.pairs(rows, engine="ours:none") == []


def test_done_cells_resume_failures_and_kv_skips():
    engines = ["ours", "plain"]
    rows = [_row(b=8), _row(engine="plain", b=8), _row(b=16), _row(engine="plain", b=16, run="r2"),
            _row(kind="fail", b=32, reason="exit 1"), _row(b=8, shape="Qwen3-8B"), _row(b=64, label="before"),
            _row(engine="plain", b=64, label="before"), _row(kind="skip", b=512, p=8192, label="before")]
    assert sw.done_cells(rows, "", "Qwen3-1.7B", engines) == {sw.Cell(8, 16, 64), sw.Cell(32, 16, 64)}
    assert sw.done_cells(rows, "before", "Qwen3-1.7B", engines, True) == {sw.Cell(64, 16, 64)}
    assert sw.done_cells(rows, "", "Qwen3-1.7B", engines, retry_failed=True) == {sw.Cell(8, 16, 64)}
    assert sw.done_cells(rows, "before", "Qwen3-1.7B", engines) == {sw.Cell(64, 16, 64), sw.Cell(512, 8192, 64)}
    assert sw.done_cells(rows, "", "Qwen3-1.7B", ["ours", "ours:none", "plain"]) == {sw.Cell(32, 16, 64)}


def test_decode_ratio_from_the_prefill_timing():
    ours = _row(s=1.3, prefill_seconds=0.3)     # 63 steps in 1.0 s
    plain = _row(engine="plain", s=1.0, prefill_seconds=0.2)  # 63 steps in 0.8 s
    pair = sw.Pair("", "Qwen3-1.7B", "ours", sw.Cell(8, 16, 64), ours, plain)
    assert pair.decode_ratio == pytest.approx(1.25) and pair.rollout_ratio == pytest.approx(1.3)
    assert sw.decode_step_s(_row(s=1.0)) is None                              # no prefill timing
    assert sw.decode_step_s(_row(s=1.0, prefill_seconds=0.95)) is None        # decode under a tenth
    assert sw.decode_step_s(_row(s=1.0, g=1, prefill_seconds=0.1)) is None


def _sweep_rows():
    """Qwen3-1.7B ours/plain on a 4 x 2 grid: slow only at batch 255 and 129 (not capture sizes)."""
    ratio = {1: 1.02, 129: 1.08, 255: 1.24, 256: 0.95}
    rows = [{"kind": "engine", "engine": e, "run_id": "r1", "capture_sizes": sw.capture_sizes()} for e in ("ours", "plain")]
    for b, x in ratio.items():
        for p in (16, 512):
            rows += [_row(b=b, p=p, s=x * (1 + p / 1024)), _row(engine="plain", b=b, p=p, s=1 + p / 1024)]
    return rows


def test_report_lists_every_miss_then_the_worst():
    lines = sw.report_lines(sw.pairs(_sweep_rows()), worst=5, goal=1.05)
    assert lines[0].startswith("Qwen3-1.7B: ours / plain, 8 cells; worst 1.240x at batch 255 x prompt 16; 4 above 1.05x")
    cells = [ln.split()[:2] for ln in lines[2:]]
    assert cells[:4] == [["255", "16"], ["255", "512"], ["129", "16"], ["129", "512"]]  # misses, worst first
    assert len(cells) == 5 and cells[4][0] == "1"  # then the worst of the rest up to 5
    assert all(ln.endswith("MISS") for ln in lines[2:6]) and not lines[6].endswith("MISS")
    assert "no (padded)" in lines[2] and " yes" in lines[6]


def test_paired_report_gives_each_run_pairs_ratio_and_flags_a_miss_in_every_pair():
    """A paired cell slower in every run pair is told apart from one whose median misses by the host's noise."""
    rows = [{"kind": "engine", "engine": e, "run_id": "r1", "capture_sizes": sw.capture_sizes()} for e in ("ours", "plain")]
    each = {320: ([0.85, 0.94, 0.89], [0.67, 0.72, 0.64]),   # every pair 1.27-1.39x
            65: ([0.40, 0.34, 0.23], [0.23, 0.23, 0.26]),    # median 1.48x, one pair 0.88x
            128: ([0.50, 0.49, 0.51], [0.50, 0.50, 0.50])}   # 0.98-1.02x
    for b, (o, pl) in each.items():
        rows += [_row(b=b, s=sorted(o)[1], seconds_each=o, paired=True),
                 _row(engine="plain", b=b, s=sorted(pl)[1], seconds_each=pl, paired=True)]
    got = {p.cell.batch: p for p in sw.pairs(rows)}
    assert [round(x, 3) for x in got[320].pair_ratios] == [round(0.85 / 0.67, 3), round(0.94 / 0.72, 3), round(0.89 / 0.64, 3)]
    assert got[320].every_pair_misses(1.05) and not got[65].every_pair_misses(1.05) and not got[128].every_pair_misses(1.05)
    lines = sw.report_lines(list(got.values()), worst=5, goal=1.05)
    assert lines[0].endswith("2 above 1.05x (1 of them in every run pair)")
    by_batch = {ln.split()[0]: ln for ln in lines[2:]}
    assert by_batch["320"].endswith("MISS (every pair)") and "1.27-1.39" in by_batch["320"]
    assert by_batch["65"].endswith("  MISS") and "0.88-1.74" in by_batch["65"]
    assert "0.98-1.02" in by_batch["128"] and "MISS" not in by_batch["128"]
    # unpaired rows (or unequal run counts) have no pair column and no "every pair" verdict
    lone = sw.pairs([dict(r, paired=False) for r in rows])
    assert all(p.pair_ratios == [] for p in lone)
    assert "(every pair)" not in "\n".join(sw.report_lines(lone, goal=1.05))


def test_heatmap_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = _sweep_rows() + [dict(r, label="after", seconds=r["seconds"] * (0.9 if r["engine"] == "ours" else 1))
                            for r in _sweep_rows() if r["kind"] == "cell"]
    out = sw.heatmap(sw.pairs(rows), tmp_path / "docs" / "sweep.png")
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="nothing to plot"):
        sw.heatmap([], tmp_path / "empty.png")


def test_rows_survive_json(tmp_path):
    """What the worker prints is what the file keeps: sorted keys, one line each."""
    path = tmp_path / "r.jsonl"
    sw.append_rows(path, [_row(warm_triton_builds=None)])
    line = path.read_text().splitlines()[0]
    assert json.loads(line)["warm_triton_builds"] is None and list(json.loads(line)) == sorted(json.loads(line))


def test_spread_is_a_percentage_of_the_median_and_a_dash_where_undefined():
    assert sw.spread({"seconds_each": [0.9, 1.0, 1.2]}) == "30.0%"
    assert sw.spread({"seconds_each": [1.0]}) == "-" and sw.spread({}) == "-"
    assert sw.spread({"seconds_each": [0.0, 0.0, 0.0001]}) == "-"  # runs that rounded to 0 s: no division by 0


# -- Qwen3-MoE (issue 64): the estimate counts the experts a step reads -------------------------------------

SIZE_MOE = sw.ModelSize.from_config(hf_config_for_shape("Qwen3-30B-A3B"))
H200 = sw.Rates(gpu_bytes=143771 * 2**20)  # nvidia-smi's memory.total of an H200, MiB


def test_moe_model_size_counts_every_expert_and_a_tokens_k():
    m = SIZE_MOE
    assert (m.experts, m.experts_per_token, m.moe_intermediate, m.sparse_layers) == (128, 8, 768, 48)
    norms = 48 * (2 * 2048 + 2 * 128) + 2048
    assert m.layer_params + 2 * m.vocab * m.hidden + norms == 30_532_122_624  # docs/moe.md's parameter count
    assert m.active_layer_params == 48 * (2048 * (4096 + 1024) + 4096 * 2048 + 2048 * 128 + 8 * 3 * 2048 * 768)
    assert m.experts_read(1) == 8 and round(m.experts_read(8), 1) == 51.6 and m.experts_read(64) > 125
    assert m.experts_read(0) == 0 and m.step_weight_bytes(1) == m.active_weight_bytes
    assert m.step_weight_bytes(10**6) == m.decode_weight_bytes  # every expert read
    assert 60.4 < m.decode_weight_bytes / 1e9 < 60.5 and 6.0 < m.active_weight_bytes / 1e9 < 6.1
    # decoder_sparse_step and mlp_only_layers pick the sparse layers as transformers and vLLM do
    cfg = {**hf_config_for_shape("Qwen3-30B-A3B"), "decoder_sparse_step": 2, "mlp_only_layers": [1, 2]}
    assert sw.ModelSize.from_config(cfg).sparse_layers == 23  # layers 3, 5, ..., 47
    assert sw.ModelSize.from_config({**cfg, "num_experts": 0}).sparse_layers == 0


def test_a_dense_models_estimate_is_unchanged_by_the_moe_terms():
    for size in (SIZE_17, SIZE_8):
        assert size.sparse_layers == 0 and size.experts_read(256) == 0
        assert size.active_weight_bytes == size.decode_weight_bytes == size.step_weight_bytes(1)
        assert size.active_layer_params == size.layer_params
    assert sw.engine_start_seconds(SIZE_8, sw.Rates()) == 60.0 + 2.0 * SIZE_8.decode_weight_bytes / 1e9
    assert sw.engine_start_seconds(SIZE_8, sw.Rates(), True) == sw.engine_start_seconds(SIZE_8, sw.Rates()) + 30


def test_moe_estimate_and_the_plan_of_the_issue_64_grid():
    """30B-A3B: a decode step reads 8 experts a layer at batch 1 and nearly all 128 at 64; its start counts the
    loading of all 60 GB but the graphs of the 6 GB a token runs through; on an H200 at 0.85 every cell of batches
    1-256 x prompts 16-4,096 fits the KV cache but 256 x 4,096 (1.07M tokens at 96 KiB each)."""
    m, r = SIZE_MOE, H200
    steps = [sw.decode_step_seconds(m, r, b, 600) for b in (1, 8, 64, 256)]
    assert steps == sorted(steps) and steps[0] < 3.2e-3 and steps[2] > 30e-3
    assert 95 < sw.engine_start_seconds(m, r) < 105  # the weights' GB alone would say 60 + 2 x 60 = 181 s
    short = sw.prefill_seconds(m, r, 1, 16)  # a 16-token prefill reads 82 of 128 experts a layer
    assert short > m.expert_bytes(m.experts_read(16)) / r.weight_bytes_per_s
    kv = sw.kv_tokens_estimate(m, r, 0.85)
    assert 600_000 < kv < 650_000 and m.kv_bytes_per_token == 98304
    assert sw.kv_tokens_estimate(m, sw.Rates(), 0.85) < 70_000  # an H100's memory: what the plan assumed before
    cells = sw.grid([1, 8, 64, 256], [16, 512, 4096], 64)
    pl = sw.plan(cells, m, r, 340, 2, 2, False, kv, compiled=1)
    assert [str(c) for c in pl.no_kv] == ["256x4096x64"] and [str(c) for c in pl.over_budget] == ["64x4096x64"]
    assert len(pl.cells) == 10 and pl.fixed_s == 2 * sw.engine_start_seconds(m, r) + 30
    assert len(sw.plan(cells, m, r, 400, 2, 2, False, kv, compiled=1).cells) == 11


def test_engine_deadline_leaves_the_later_engines_their_start():
    assert sw.engine_deadline(100.0, 400.0, [50.0, 50.0]) == 250.0  # equal starts: half of what is left
    d = sw.engine_deadline(100.0, 400.0, [50.0, 80.0])  # the next one starts 30 s slower
    assert d == 100 + 50 + (300 - 130) / 2 and d < 250.0
    assert sw.engine_deadline(100.0, 400.0, [80.0]) == 400.0  # the last engine: the end
    assert sw.engine_deadline(100.0, 170.0, [50.0, 80.0]) == 150.0  # no time for cells: its start only
    assert sw.engine_deadline(100.0, 120.0, [50.0, 80.0]) == 120.0  # never past the end


def test_gpu_memory_from_nvidia_smi(monkeypatch):
    calls = []

    def run(out):
        def fake(cmd, **kw):
            calls.append(cmd)
            if isinstance(out, BaseException):
                raise out
            return type("Done", (), {"stdout": out})()
        return fake

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert sw.gpu_memory_bytes(run("143771\n")) == 143771 * 2**20 and "--id" not in " ".join(calls[-1])
    assert sw.gpu_memory_bytes(run("143771\n81559\n")) == 81559 * 2**20  # the smallest
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    sw.gpu_memory_bytes(run("143771\n"))
    assert calls[-1][-1] == "--id=3"
    assert sw.gpu_memory_bytes(run(FileNotFoundError("nvidia-smi"))) is None
    assert sw.gpu_memory_bytes(run("No devices were found\n")) is None
    assert sw.gpu_memory_bytes(run("")) is None
