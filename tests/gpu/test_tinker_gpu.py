"""The Tinker API on real vLLM: concurrent `sample` calls are run as one engine batch, whatever
happens to arrive together, so a request must get the same bits in any batch; and tinker-cookbook's
own RL loop trains through the API with every sampled token compared and none different."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compare.parity_matrix import random_prompts
from spirl.engines.base import Request

ROOT = Path(__file__).resolve().parents[2]


def test_a_request_gets_the_same_bits_in_any_batch(tiny_harness):
    """Requests with their own seed, n, length and temperature: one batch, three batches, one at a
    time. (No top-p / top-k here: vLLM 0.26 runs its top-p/top-k code for every row of a batch in
    which any row uses it, with another kernel below 8 rows, so *processed* logprobs of such
    requests depend on their batch; the API reports raw logprobs, which do not.)"""
    engine = tiny_harness.engine
    prompts = random_prompts([3, 40, 200, 7, 900, 64, 15, 300, 1, 120, 33, 500], 11)
    requests = [Request(p, n=1 + i % 3, max_tokens=24 + 8 * (i % 4), temperature=[1.0, 0.7][i % 2], seed=100 + i,
                        ignore_eos=True) for i, p in enumerate(prompts)]
    batch = engine.sample(requests)
    thirds = engine.sample(requests[:4]) + engine.sample(requests[4:8]) + engine.sample(requests[8:])
    alone = [engine.sample([r])[0] for r in requests]
    for got in (thirds, alone):
        for a, b in zip(batch, got, strict=True):
            assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
            assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b, strict=True))
    assert sum(len(s.completion_ids) for g in batch for s in g) == sum(r.n * r.max_tokens for r in requests)


def test_one_request_of_n_is_n_requests_of_consecutive_seeds(tiny_harness):
    """What the API's merging of a group's one-sample requests relies on (backend.Session._sample,
    VLLMEngine.seeds_children): vLLM's request of n samples and seed s gives, bit for bit, the n
    requests of one sample and seeds s, s+1, ..., each alone."""
    engine = tiny_harness.engine
    prompt = random_prompts([37], 5)[0]
    merged = engine.sample([Request(prompt, n=5, max_tokens=32, temperature=1.0, seed=1234, ignore_eos=True)])[0]
    alone = [engine.sample([Request(prompt, n=1, max_tokens=32, temperature=1.0, seed=1234 + i, ignore_eos=True)])[0][0]
             for i in range(5)]
    assert [s.completion_ids for s in merged] == [s.completion_ids for s in alone]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(merged, alone, strict=True))
    assert len({tuple(s.completion_ids) for s in merged}) > 1  # the seeds differ, so do the draws


def test_cookbook_rl_loop_on_vllm_compares_every_iteration(gpu_tiny_ckpt, tmp_path):
    pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is not installed (see README: Tinker API)")
    env = dict(os.environ, SPIRL_TINKER_DIR=str(tmp_path / "tinker_runs"), SPIRL_GPU_MEMORY_UTILIZATION="0.25")
    cmd = [sys.executable, "-m", "spirl.tinker", "compare/tinker_task.py", "--model", gpu_tiny_ckpt, "--log-path",
           str(tmp_path / "log"), "--task", "synthetic", "--iterations", "3", "--eval-every", "0"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    m = re.search(r"parity: (\d+) forward_backward calls, (\d+) sampled tokens compared, (\d+) different; "
                  r"fewest compared in a call: (\d+)", proc.stdout)
    assert m, "tinker_task printed no parity line"
    calls, compared, different, fewest = map(int, m.groups())
    assert calls == 3 and different == 0 and fewest > 0 and compared >= 3 * fewest


def test_a_failing_script_closes_the_engine(gpu_tiny_ckpt, tmp_path):
    """A Tinker script that raises: one error line, and the launcher closes the vLLM engine on the
    way out (no "destroy_process_group() was not called" at exit)."""
    script = tmp_path / "fails.py"
    script.write_text("import sys, tinker\n"
                      "tc = tinker.ServiceClient().create_lora_training_client(base_model=sys.argv[1], rank=2).result()\n"
                      "raise RuntimeError('the user script failed')\n")
    env = dict(os.environ, SPIRL_TINKER_DIR=str(tmp_path / "tinker_runs"), SPIRL_GPU_MEMORY_UTILIZATION="0.25")
    proc = subprocess.run([sys.executable, "-m", "spirl.tinker", str(script), gpu_tiny_ckpt], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode != 0 and "the user script failed" in proc.stderr
    assert "engine closed" in proc.stdout
    assert "destroy_process_group" not in proc.stdout + proc.stderr
