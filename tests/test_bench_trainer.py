"""compare/bench_trainer.py on CPU: the table, the ours-vs-torchtitan logprob check, --json, errors.

The main run is the documented CPU smoke run (`--shape tiny --shapes 2x64,mixed4 --dtype float32`, one
iteration: tiny keeps Qwen3's 151,936-token vocabulary, so lm_head dominates). float32, because a CPU without native
bf16 matmuls runs the bf16 run many times slower: 84 s in float32 against more than 600 s in bf16 on two cores of an
AMD EPYC (2026-11-27), where Intel CPUs with bf16 instructions had taken about 40 s in bf16. The packed
block_causal run uses --model with a one-layer tiny checkpoint cut to a 4,096-token vocabulary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from compare import bench_trainer

ROOT = Path(__file__).resolve().parents[1]
SMALL_VOCAB = 4096


@pytest.fixture(scope="module")
def small_vocab_ckpt(module_dir) -> Path:
    from weights import load_hf_checkpoint, save_hf_checkpoint, write_random_checkpoint

    base = module_dir
    src = write_random_checkpoint(base / "tiny", "tiny", num_layers=1, seed=0, dtype=torch.float32)
    cfg, sd = load_hf_checkpoint(src)
    cfg.update(vocab_size=SMALL_VOCAB, bos_token_id=0, eos_token_id=1)
    (src / "config.json").write_text(json.dumps(cfg))
    sd = {k: v[:SMALL_VOCAB] if k in ("model.embed_tokens.weight", "lm_head.weight") else v for k, v in sd.items()}
    return save_hf_checkpoint(sd, src, base / "tiny-small-vocab")


def run_bench(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "compare.bench_trainer", "--device", "cpu", "--iters", "1", "--warmup", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_cpu_run_prints_table_passes_check_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = run_bench("--shape", "tiny", "--shapes", "2x64,mixed4", "--dtype", "float32", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout
    assert "logprob agreement (ours vs torchtitan, all shapes): PASS" in text
    assert text.count("logprob check: ") == 2 and text.count(" PASS\n") >= 2
    assert "ours s" in text and "tt MFU" in text and "ours GiB" in text
    assert "== 2x64:" in text and "sdpa [2, 64] causal" in text
    assert "== mixed4:" in text and "right-padded" in text  # CPU: torchtitan's mixed batch is padded sdpa
    data = json.loads(out.read_text())
    assert data["logprob_agreement"] == "PASS" and data["ours_backend"] == "reference"
    assert {"device", "peak_tflops", "model_args", "activation_checkpointing", "tolerances"} <= set(data)
    assert set(data["shapes"]) == {"2x64", "mixed4"}
    mixed = data["shapes"]["mixed4"]
    assert mixed["lengths"] == bench_trainer.batch_lengths("mixed4") and mixed["tokens"] == sum(mixed["lengths"])
    assert mixed["check"]["pass"] and mixed["check"]["rel_sum_diff"] <= bench_trainer.SUM_REL_TOL
    for shape in data["shapes"].values():
        for p in ("forward", "fwd_bwd"):
            assert shape[p]["ours"]["s"] > 0 and shape[p]["torchtitan"]["s"] > 0 and shape[p]["ratio"] > 0
            assert shape[p]["ours"]["tok_s"] == pytest.approx(shape["tokens"] / shape[p]["ours"]["s"])


@pytest.mark.slow
def test_packed_block_causal_layout_agrees_and_a_failing_pass_is_reported(small_vocab_ckpt):
    """torchtitan packed [1, T] with block_causal documents (flex: the layout varlen uses on a GPU),
    positions restarting per sequence. Flex has no CPU backward: torch may report that pass as an
    error, and the bench goes on."""
    r = run_bench("--model", str(small_vocab_ckpt), "--shapes", "mixed3", "--tt-attn", "flex",
                  "--activation-checkpointing", "0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"flex [1, {sum(bench_trainer.batch_lengths('mixed3'))}] packed, block_causal" in r.stdout
    assert "logprob agreement (ours vs torchtitan, all shapes): PASS" in r.stdout


def test_flex_mask_is_built_on_the_batch_device_where_the_wheel_reports_cuda(monkeypatch):
    """A CUDA wheel on a machine without a GPU reports torch.accelerator.current_accelerator() as
    cuda, create_block_mask's default device: torchtitan 0.2.2's own flex mask build then fails on
    the CPU ("Tensor device mismatch ... cuda:0 and cpu"). The bench builds torchtitan's block_causal
    mask on the batch's device: causal within each sequence, nothing across sequences."""
    from torch.nn.attention.flex_attention import create_mask

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    _, mask, positions, _ = bench_trainer.tt_batch(None, [[5, 6, 7], [8, 9, 10, 11]], "flex", torch.device("cpu"))
    assert mask.kv_num_blocks.device == torch.device("cpu")
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    q, kv = torch.arange(7)[:, None], torch.arange(7)[None]
    assert torch.equal(create_mask(mask.mask_mod, 1, 1, 7, 7, device="cpu")[0, 0], (kv <= q) & (doc[q] == doc[kv]))
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3]]


def test_shapes_flops_and_argument_errors(capsys):
    mixed = torch.randint(32, 2049, (64,), generator=torch.Generator().manual_seed(0)).tolist()  # the module doc's
    assert bench_trainer.batch_lengths("mixed64") == mixed
    assert bench_trainer.batch_lengths("2x8192") == [8192, 8192]
    a = SimpleNamespace(dim=2, n_heads=1, n_kv_heads=1, head_dim=2, hidden_dim=3, n_layers=1, vocab_size=5)
    n_mm = 2 * 3 * 2 + 2 * 2 + 3 * 2 * 3 + 5 * 2  # qkv + o + gate/up/down + lm_head
    assert bench_trainer.model_flops(a, [4]) == 2 * n_mm * 4 + 2 * 2 * 16 / 2 * 1 * 2
    for argv, message in ((["--shapes", "8y3"], "use BxS"), (["--iters", "0"], "--iters must be >= 1"),
                          (["--tt-attn", "dense"], "invalid choice")):
        with pytest.raises(SystemExit) as e:
            bench_trainer.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
