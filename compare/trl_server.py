"""vLLM's OpenAI server as TRL's server mode starts it, on GPUs of its own: the generation side of TRL's
GRPOTrainer (`vllm_mode="server"`) and AsyncGRPOTrainer when they are compared with SPIRL's engines on GPUs of
their own (`--generation-gpus`).

The command is TRL's own (`trl vllm-serve`'s `build_command`: `vllm serve MODEL` with the NCCL weight-transfer
engine, processed logprobs and no logprob cap), run with `VLLM_SERVER_DEV_MODE=1` (the weight-transfer endpoints),
plain vLLM (`VLLM_BATCH_INVARIANT=0`) and vLLM's default engine-core process (`VLLM_ENABLE_V1_MULTIPROCESSING=1`,
whatever the environment sets for in-process engines). `serve()` starts it, waits until `/health` answers, yields
its URL and stops it; a server that exits or does not answer in time is one error line with its log's tail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def command(model: str, port: int, gpu_memory_utilization: float, max_model_len: int) -> list[str]:
    """TRL's `trl vllm-serve` command line for `model` (a checkpoint directory) on `port`."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    return build_command(ScriptArguments(model=model, host="127.0.0.1", port=port, max_model_len=max_model_len,
                                         gpu_memory_utilization=gpu_memory_utilization))


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


@contextmanager
def serve(cmd: list[str], gpus: str, log: Path, port: int, timeout_s: float = 900.0, env: dict | None = None):
    """Runs `cmd` (a server listening on 127.0.0.1:`port`) on the GPUs `gpus` (CUDA_VISIBLE_DEVICES), its output
    in `log`; yields its URL once `/health` answers; stops it and the processes it started (SIGTERM to its process
    group, then SIGKILL after 30 s) on the way out."""
    url = f"http://127.0.0.1:{port}"
    if _healthy(url):
        raise SystemExit(f"error: something already answers on {url}; stop it, or start this server on another port")
    log.parent.mkdir(parents=True, exist_ok=True)
    run_env = {**os.environ, **(env or {}), "CUDA_VISIBLE_DEVICES": gpus, "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_BATCH_INVARIANT": "0",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the server's engine core in a process of its own
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=run_env, start_new_session=True)
    try:
        start = time.monotonic()
        while not _healthy(url):
            if proc.poll() is not None:
                raise SystemExit(f"error: the vLLM server exited ({proc.returncode}) before answering; "
                                 f"its log {log} ends:\n{_tail(log)}")
            if time.monotonic() - start > timeout_s:
                raise SystemExit(f"error: the vLLM server did not answer {url}/health within {timeout_s:.0f} s; "
                                 f"its log {log} ends:\n{_tail(log)}")
            time.sleep(1.0)
        print(f"trl_server: {url} ready after {time.monotonic() - start:.0f} s on GPU(s) {gpus} (log {log})",
              flush=True)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)  # vLLM's engine core runs in a child process of the server
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
