"""Checkpoints are byte-identical when their contents are: a run interrupted after step 2 and resumed
(in another process, as a resume always is) writes a step-3 checkpoint whose every file has the
sha256 of the uninterrupted run's, for LoRA and full fine-tuning; and the writers' sources of
run-to-run variation (safetensors metadata order, PEFT's target_modules set) are fixed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spirl.core.config import TrainConfig
from torchtitan_compat.lora import LoRASpec, parse_targets
from torchtitan_compat.peft_adapter import write_adapter
from torchtitan_compat.safetensors_io import save_tensors

REPO = Path(__file__).resolve().parents[1]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _hashes(step_dir: Path) -> dict[str, str]:
    return {p.name: _sha256(p) for p in sorted(step_dir.iterdir())}


def test_safetensors_bytes_follow_from_contents(tmp_path):
    """Metadata and tensors given in other orders: the same file, loadable, metadata keys sorted."""
    from safetensors import safe_open

    a = {"w": torch.arange(6.0).reshape(2, 3), "s": torch.tensor(3.0), "rng": torch.arange(5, dtype=torch.uint8)}
    save_tensors(tmp_path / "1.safetensors", a, {"format": "pt", "spirl_base_fingerprint": "x"})
    save_tensors(tmp_path / "2.safetensors", dict(reversed(a.items())), {"spirl_base_fingerprint": "x", "format": "pt"})
    assert (tmp_path / "1.safetensors").read_bytes() == (tmp_path / "2.safetensors").read_bytes()
    raw = (tmp_path / "1.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert list(header["__metadata__"]) == ["format", "spirl_base_fingerprint"]
    with safe_open(str(tmp_path / "1.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "spirl_base_fingerprint": "x"}
        assert all(torch.equal(f.get_tensor(k), v) for k, v in a.items())


def test_adapter_config_lists_targets_in_order(tmp_path):
    """PEFT's LoraConfig keeps target_modules as a set (listed in a per-process order); ours is the spec's list."""
    spec = LoRASpec(2, 4.0, parse_targets("all-linear,lm_head"))
    write_adapter(tmp_path, {}, spec)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"] == list(spec.targets)


def _cfg(tiny_ckpt, tmp: Path, lora: bool, **kw) -> TrainConfig:
    base = dict(model=str(tiny_ckpt), engine="native", dtype="float32", device="cpu", task="synthetic", steps=3,
                prompts_per_step=2, group_size=4, max_new_tokens=4, lr=1e-2 if lora else 1e-3, kl_coef=0.1,
                max_tokens_per_microbatch=40, checkpoint_every=0, out_dir=str(tmp / "runs"),
                checkpoint_dir=str(tmp / "ckpt"), run_name="uninterrupted")
    if lora:
        base.update(lora_rank=2, lora_targets="all-linear,lm_head")
    return TrainConfig(**{**base, **kw}).validate()


def _argv(cfg: TrainConfig) -> list[str]:
    """simple_rl.py's flags for `cfg` (those that differ from the defaults)."""
    default = TrainConfig()
    return [a for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)
            for a in (f"--{f.name.replace('_', '-')}", str(getattr(cfg, f.name)))]


@pytest.mark.parametrize("lora", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["lora", "full"])
def test_resumed_checkpoint_is_byte_identical(tiny_ckpt, tmp_path, lora):
    from spirl.loops.run import train

    full = train(_cfg(tiny_ckpt, tmp_path, lora))
    assert all(s["parity/tokens_different"] == 0 for s in full)
    assert sum(not s["skipped_update"] for s in full) >= 2, "too few steps updated the policy to test anything"
    train(_cfg(tiny_ckpt, tmp_path, lora, run_name="interrupted", steps=2))
    resume = _cfg(tiny_ckpt, tmp_path, lora, run_name="interrupted", resume=str(tmp_path / "ckpt" / "interrupted"))
    r = subprocess.run([sys.executable, str(REPO / "simple_rl.py"), *_argv(resume)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert r.returncode == 0, r.stderr
    a = _hashes(tmp_path / "ckpt" / "uninterrupted" / "step_000003")
    b = _hashes(tmp_path / "ckpt" / "interrupted" / "step_000003")
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert {weights, "optimizer.safetensors", "rng.safetensors", "state.json"} <= set(a)
    assert a == b, [name for name in a if a[name] != b.get(name)]
