"""compare/cold_start.py: cold and warm runs share one fresh kernel-cache folder, vLLM's own
durations are read from its log lines, milestones are stamped, and a failing command fails."""

from __future__ import annotations

import sys
import textwrap

import pytest

from compare import cold_start

# A stand-in for a vLLM process: prints vLLM 0.26.0's log lines, and compiles (sleeps, then writes a
# cache entry) only when TRITON_CACHE_DIR is empty, as Triton does.
FAKE = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    cold = not cache.exists()
    print("INFO 11-25 20:37:25 [model.py:623] Resolved architecture: Qwen3ForCausalLM")
    print("INFO 11-25 20:37:26 [default_loader.py:431] Loading weights took 1.25 seconds")
    print("INFO 11-25 20:37:26 [gpu_model_runner.py:5348] Model loading took 3.2 GiB memory and 1.500000 seconds")
    if cold:
        time.sleep(0.6)
        cache.mkdir(parents=True)
        (cache / "kernel.cubin").write_text("x")
        print("WARNING 11-25 20:37:27 [jit_monitor.py:120] Triton kernel JIT compilation during inference: _bi_matmul_kernel. ")
    print("INFO 11-25 20:37:27 [gpu_model_runner.py:6845] Graph capturing finished in 4 secs, took 0.50 GiB")
    if cold:
        time.sleep(0.4)  # the warm-up's sampler JIT
    print("INFO 11-25 20:37:27 [jit_monitor.py:79] Kernel JIT monitor activated; monitored JIT compilations")
    print("INFO 11-25 20:37:27 [core.py:348] init engine (profile, create kv cache, warmup model) took 9.75 s")
    print("spirl.engines.vllm_engine: vLLM engine ready in 12.3s (/m, cuda graphs: full_decode_only)")
    print("trainer kernel backend: vllm")
    print("step 1/3  reward 0.5")
    sys.exit(int(os.environ.get("FAKE_RC", "0")))
""")


def test_cold_then_warm_breakdown(tmp_path, capsys):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    rc = cold_start.main(["--runs", "2", "--until", r"step 1/", "--out", str(tmp_path / "logs"), "--",
                          sys.executable, str(script)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
            for line in out.splitlines() if line.startswith("| ") and line.count("|") == 4}
    assert rows["vLLM: loading weights"] == ["1.2", "1.2"]  # 1.25 printed with one decimal
    assert rows["vLLM: CUDA-graph capture"] == ["4.0", "4.0"]
    assert rows["vLLM: init engine (profile, KV cache, warm-up, graphs)"] == ["9.8", "9.8"]
    assert rows["SPIRL: vLLM engine start (VLLMEngine)"] == ["12.3", "12.3"]
    assert rows["vLLM: torch.compile"] == ["-", "-"]  # not logged: shown as missing, not as 0
    assert rows["Triton kernels compiled after vLLM's warm-up"] == ["1", "0"]
    cold, warm = (float(v) for v in rows["time to first line matching 'step 1/' (s)"])
    assert cold > warm + 0.4  # the cold run compiled (slept 0.6 s); the warm one found the cache
    assert (tmp_path / "logs" / "run1_cold.log").read_text().split()[0].replace(".", "").isdigit()
    warmup_stage = [float(c) for c in rows["stage: previous -> vLLM warm-up done (JIT monitor on)"]]
    assert warmup_stage[0] > warmup_stage[1] + 0.3  # the cold run's 0.4 s "JIT" lands in its own stage
    assert "stage: previous -> model class inspected (architecture resolved)" in rows

    # --from-logs: the same table again from the kept logs, without running anything
    assert cold_start.main(["--from-logs", str(tmp_path / "logs"), "--until", r"step 1/"]) == 0
    again = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
             for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line.count("|") == 4}
    assert again["vLLM: CUDA-graph capture"] == ["4.0", "4.0"]
    assert again["stage: previous -> vLLM warm-up done (JIT monitor on)"] == \
        rows["stage: previous -> vLLM warm-up done (JIT monitor on)"]


def test_from_logs_rejects_a_folder_without_logs(tmp_path):
    with pytest.raises(SystemExit, match="no run"):
        cold_start.main(["--from-logs", str(tmp_path)])


def test_failing_command_fails(tmp_path, monkeypatch, capsys):
    script = tmp_path / "fake.py"
    script.write_text(FAKE)
    monkeypatch.setenv("FAKE_RC", "3")
    assert cold_start.main(["--runs", "1", "--out", str(tmp_path / "logs"), "--", sys.executable, str(script)]) == 1
    assert "exit 3" in capsys.readouterr().out


def test_a_command_without_milestones_still_gets_a_table():
    r = cold_start.summarize([(0.5, "hello"), (1.0, "bye")], 0, 1.2, None)
    out = cold_start.table([r, r], None)
    assert "| total wall clock (s)" in out and "stage:" not in out
