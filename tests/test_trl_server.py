"""compare/trl_server.py and compare/trl_grpo.py's server layouts, without a GPU: TRL's own `vllm serve`
command, the server's start (waited for until /health answers), stop (its whole process group) and failure
(one error with its log's tail), the configs of GRPOTrainer's server mode and AsyncGRPOTrainer, and the
reward that AsyncGRPOTrainer's spawned scorer unpickles."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys

import pytest

pytest.importorskip("trl")

from compare import trl_grpo, trl_server  # noqa: E402

# A stand-in server: answers 200 on /health, 404 elsewhere; starts a child that sleeps (as vLLM's engine core)
# and writes the child's pid where the test can read it.
FAKE = r"""
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by its parent) is not running
        return f.read().split(")")[1].split()[0] != "Z"


def test_command_is_trls_vllm_serve_with_the_weight_transfer_engine():
    cmd = trl_server.command("/ckpt", 8123, 0.9, 4096)
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/ckpt"]
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags["--port"] == "8123" and flags["--host"] == "127.0.0.1" and flags["--max-model-len"] == "4096"
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "nccl"}
    assert flags["--logprobs-mode"] == "processed_logprobs"


def test_serve_waits_for_health_then_stops_the_server_and_its_children(tmp_path):
    port, pid_file = _free_port(), tmp_path / "child.pid"
    cmd = [sys.executable, "-c", FAKE, str(port), str(pid_file)]
    with trl_server.serve(cmd, "", tmp_path / "server.log", port, timeout_s=60) as url:
        assert url == f"http://127.0.0.1:{port}" and trl_server._healthy(url)
        child = int(pid_file.read_text())
        assert _alive(child)
    assert not trl_server._healthy(url)
    subprocess.run(["sleep", "0.5"])
    assert not _alive(child)


def test_a_server_that_exits_is_one_error_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('CUDA out of memory (stand-in)'); sys.exit(3)"]
    with pytest.raises(SystemExit) as e:
        with trl_server.serve(cmd, "", tmp_path / "server.log", _free_port(), timeout_s=60):
            pass
    assert str(e.value).startswith("error: the vLLM server exited (3) before answering")
    assert "CUDA out of memory (stand-in)" in str(e.value)


def test_configs_of_the_server_layouts():
    sync = trl_grpo._args(["--model", "/m", "--vllm", "server", "--server-url", "http://127.0.0.1:1"])
    config, _ = trl_grpo.trainer_args(sync, 48, 1, False)
    assert (type(config).__name__, config.vllm_mode, config.use_vllm) == ("GRPOConfig", "server", True)
    assert config.vllm_server_base_url == "http://127.0.0.1:1" and config.generation_batch_size == 48
    a = trl_grpo._args(["--model", "/m", "--vllm", "server", "--server-url", "http://127.0.0.1:1", "--trainer",
                        "async", "--max-staleness", "2", "--micro-batch", "8"])
    config, _ = trl_grpo.trainer_args(a, 48, 1, False)
    assert type(config).__name__ == "AsyncGRPOConfig" and config.max_staleness == 2
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 48  # samples a step
    with pytest.raises(SystemExit):
        trl_grpo._args(["--model", "/m", "--trainer", "async"])  # async needs a server


def test_task_reward_survives_pickling_as_the_spawned_scorer_gets_it(tiny_ckpt):
    from spirl.core.preflight import load_checked_tokenizer
    from spirl.tasks import get_task

    task = get_task("arith", load_checked_tokenizer(tiny_ckpt))
    rows = trl_grpo.dataset_rows(task, 1, 2, 0)
    ids = [task.tokenizer.encode(" 12"), task.tokenizer.encode("7")]
    metas = [r["meta"] for r in rows]
    reward = trl_grpo.TaskReward("arith", str(tiny_ckpt))
    first = reward(prompts=[], completions=[], completion_ids=ids, meta=metas)
    again = pickle.loads(pickle.dumps(reward))
    assert again.task is None and again.__name__ == "arith_reward"
    assert again(prompts=[], completions=[], completion_ids=ids, meta=metas) == first
    assert first == [task.reward(list(i), json.loads(m)) for i, m in zip(ids, metas)]


def test_async_rows_render_to_the_tasks_prompt_ids(tiny_ckpt):
    """AsyncGRPOTrainer's rollout renders each row's messages with the chat template and sends those ids."""
    from spirl.core.preflight import load_checked_tokenizer
    from spirl.loops.prompts import DataCursor, PromptSource
    from spirl.tasks import get_task

    task = get_task("arith", load_checked_tokenizer(tiny_ckpt))
    rows, tokenizer = trl_grpo.as_conversations(trl_grpo.dataset_rows(task, 2, 3, 0), task.tokenizer)
    source, want = PromptSource(task, 0, DataCursor()), []
    for step in (1, 2):
        source.begin(step)
        want += [ids for ids, _ in source.draw(3)]
    got = [list(tokenizer.apply_chat_template(r["prompt"], return_dict=False, add_generation_prompt=True))
           for r in rows]
    assert got == want and task.tokenizer.chat_template != tokenizer.chat_template  # the task's own is untouched
    # what the rollout worker's process gets: TRL's response parser for Qwen3's template travels with the copy
    # (the worker refuses the pass-through template otherwise)
    sent = pickle.loads(pickle.dumps(tokenizer))
    assert sent.chat_template == trl_grpo.PASS_THROUGH_TEMPLATE
    assert getattr(sent, "response_template", None) or getattr(sent, "response_schema", None)
    assert not getattr(task.tokenizer, "response_template", None)


def test_async_trainer_without_the_kernel_hub_is_left_out_before_any_server_starts(tmp_path, monkeypatch):
    """AsyncGRPOTrainer fetches FlashAttention-3 from the Hugging Face kernel hub: without its client installed the
    run is refused in one line, before minutes go into a server."""
    def no_server(*a, **k):
        raise AssertionError("a server was started")

    monkeypatch.setattr(trl_grpo, "hub_kernels_installed", lambda: False)
    monkeypatch.setattr(trl_server, "serve", no_server)
    step, why = trl_grpo.launch("/unused", 1, tmp_path / "trl-async", prompts_per_step=2, group_size=2,
                                max_new_tokens=4, steps=2, skip=0, layout="async")
    assert step is None and why == trl_grpo.ASYNC_NEEDS_HUB_KERNELS and "\n" not in why


def test_bench_keeps_the_server_anchor_when_the_async_trainer_cannot_run(tiny_ckpt, tmp_path, monkeypatch, capsys):
    from argparse import Namespace

    from compare import offpolicy_bench

    def fake_launch(model, gpus, out, *, layout, **kw):
        return (None, trl_grpo.ASYNC_NEEDS_HUB_KERNELS) if layout == "async" else (6.5, "trl_grpo: median 6.5 s")

    monkeypatch.setattr(trl_grpo, "launch", fake_launch)
    a = Namespace(model=str(tiny_ckpt), out=str(tmp_path), trl=[], trl_server=[1], prompts_per_step=2, group_size=2,
                  max_new_tokens=4, steps=2, skip=0, trl_args="", k=1)
    assert offpolicy_bench.run_trl(a) == {"server-1+1": (2, 6.5)}
    assert "trl-async-1+1: AsyncGRPOTrainer left out" in capsys.readouterr().out
    fail = {"colocate": (None, "exit 1, no summary")}
    monkeypatch.setattr(trl_grpo, "launch", lambda *x, layout, **k: fail.get(layout, (6.5, "")))
    with pytest.raises(SystemExit):  # any other anchor failing still stops the bench
        offpolicy_bench.run_trl(Namespace(**{**vars(a), "trl": [1], "trl_server": []}))
