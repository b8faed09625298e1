"""compare/bench_trainer.py on CPU: the table, the ours-vs-torchtitan logprob check, --json, errors.

The main run is the documented CPU smoke run (`--shape tiny --shapes 2x64,mixed4 --dtype float32`, one
iteration: tiny keeps Qwen3's 151,936-token vocabulary, so lm_head dominates). float32, because a CPU without native
bf16 matmuls runs the bf16 run many times slower: 84 s in float32 against more than 600 s in bf16 on two cores of an
AMD EPYC (2026-11-27), where Intel CPUs with bf16 instructions had taken about 40 s in bf16. The packed
block_causal run uses --model with a one-layer tiny checkpoint cut to a 4,096-token vocabulary, the Qwen3-MoE run
tiny-moe cut the same way.
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


def small_vocab(base: Path, shape: str, num_layers: int | None = None) -> Path:
    """A random float32 checkpoint of `shape` with its vocabulary cut to SMALL_VOCAB rows."""
    from weights import load_hf_checkpoint, save_hf_checkpoint, write_random_checkpoint

    src = write_random_checkpoint(base / shape, shape, num_layers=num_layers, seed=0, dtype=torch.float32)
    cfg, sd = load_hf_checkpoint(src)
    cfg.update(vocab_size=SMALL_VOCAB, bos_token_id=0, eos_token_id=1)
    (src / "config.json").write_text(json.dumps(cfg))
    sd = {k: v[:SMALL_VOCAB] if k in ("model.embed_tokens.weight", "lm_head.weight") else v for k, v in sd.items()}
    return save_hf_checkpoint(sd, src, base / f"{shape}-small-vocab")


@pytest.fixture(scope="module")
def small_vocab_ckpt(module_dir) -> Path:
    return small_vocab(module_dir, "tiny", num_layers=1)


@pytest.fixture(scope="module")
def small_vocab_moe_ckpt(module_dir) -> Path:
    """tiny-moe (3 layers: 0 dense, 1 and 2 sparse with 8 experts, top-2) with a 4,096-token vocabulary."""
    return small_vocab(module_dir, "tiny-moe")


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


def test_moe_flops_count_the_active_weights():
    """A sparse layer's MLP term in N_mm is its router and its k experts (D*E + k*3*D*I_moe), a dense layer's 3*D*I."""
    moe_args = SimpleNamespace(num_experts=4, top_k=2)
    a = SimpleNamespace(dim=2, n_heads=1, n_kv_heads=1, head_dim=2, hidden_dim=3, n_layers=2, vocab_size=5,
                        sparse_layers=(1,), moe_args=moe_args, moe_inter_dim=6)
    attention = 2 * 3 * 2 + 2 * 2
    n_mm = 2 * attention + 3 * 2 * 3 + (2 * 4 + 2 * 3 * 2 * 6) + 5 * 2
    assert bench_trainer.active_matmul_params(a) == n_mm
    assert bench_trainer.model_flops(a, [4]) == 2 * n_mm * 4 + 2 * (2 * 2 * 16 / 2 * 1 * 2)


def test_moe_weights_map_as_torchtitans_adapter(small_vocab_moe_ckpt):
    """The sparse layers' router and experts in torchtitan's layout (its Qwen3StateDictAdapter's names, experts stacked
    over e: w1 = gate_proj, w3 = up_proj, w2 = down_proj), the dense layer's MLP as its feed_forward; torchtitan's
    Qwen3Model with layer 0 dense loads the result with strict=True."""
    from torchtitan_compat.config import model_args_from_hf_config
    from weights import load_hf_checkpoint

    cfg, hf = load_hf_checkpoint(small_vocab_moe_ckpt)
    a = model_args_from_hf_config(cfg)
    titan = bench_trainer.titan_state_dict(hf, a)
    p = "model.layers.2.mlp."
    assert torch.equal(titan["layers.2.moe.router.gate.weight"], hf[p + "gate.weight"])
    for w, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        stacked = titan[f"layers.2.moe.experts.{w}"]
        assert stacked.shape[0] == 8 and all(torch.equal(stacked[e], hf[f"{p}experts.{e}.{name}.weight"])
                                             for e in range(8))
    assert "layers.0.feed_forward.w1.weight" in titan and not any(k.startswith("layers.0.moe") for k in titan)
    model = bench_trainer.build_tt(a, titan, "sdpa", False, torch.device("cpu"), torch.float32)
    assert [i for i, layer in model.layers.items() if layer.moe_enabled] == ["1", "2"]


@pytest.mark.slow
def test_cpu_moe_run_agrees_and_times_the_sparse_layer(small_vocab_moe_ckpt, tmp_path):
    """tiny-moe (float32, CPU): our model against torchtitan's Qwen3 MoE (its for-loop experts on the CPU), the
    logprob check passes; our first sparse layer alone and torchtitan's MoE module on it are timed; the JSON holds
    the MoE args and MFU's active-weight count."""
    out = tmp_path / "bench.json"
    r = run_bench("--model", str(small_vocab_moe_ckpt), "--shapes", "2x64", "--dtype", "float32",
                  "--moe-layer-tokens", "512", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "mixture of experts: 2 sparse layers, 8 experts of width 64, top-2" in r.stdout
    assert "== sparse layer 1 alone, 512 tokens" in r.stdout and "torchtitan MoE" in r.stdout
    assert "logprob agreement (ours vs torchtitan, all shapes): PASS" in r.stdout
    data = json.loads(out.read_text())
    assert data["moe"]["sparse_layers"] == [1, 2] and data["moe"]["torchtitan_experts"] == "for-loop"
    layer = data["sparse_layer"]
    assert layer["experts_backward"] == "loop" and "ours_loop" not in layer  # the grouped path is CUDA's
    assert layer["ours"]["fwd_bwd_ms"] > 0 and layer["torchtitan"]["fwd_bwd_ms"] > 0
    for p in ("forward", "fwd_bwd"):
        assert data["shapes"]["2x64"][p]["ratio"] > 0
