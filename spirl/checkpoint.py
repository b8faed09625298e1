"""Atomic training checkpoints: fp32 master weights, AdamW state, step, RNG states.

Layout under <checkpoint_dir>/<run_name>/:
    step_000010/model.safetensors       fp32 master weights (compat names)
    step_000010/optimizer.safetensors   AdamW per-parameter tensors (exp_avg, exp_avg_sq, step)
    step_000010/rng.safetensors         torch CPU (and CUDA) generator states
    step_000010/state.json              step, config, param_groups, python RNG state
    latest                              name of the newest complete step directory

A step directory is written under a temporary name and renamed into place (atomic on one
filesystem); `latest` is then replaced with os.replace. A crash at any point leaves the previous
checkpoint intact and `latest` pointing to it. The newest KEEP complete checkpoints are kept.
Everything is loaded with safetensors / JSON (no pickle).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

KEEP = 2


class CheckpointError(ValueError):
    """A checkpoint is missing or unusable; one line saying what to do."""


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": v.detach().cpu().contiguous()
               for i, st in sd["state"].items() for k, v in st.items()}
    return tensors, sd["param_groups"]


def save(run_ckpt_dir: str | Path, step: int, masters: dict[str, torch.Tensor],
         optimizer: torch.optim.Optimizer, state: dict) -> Path:
    """Write checkpoint `step` atomically; returns its directory."""
    root = Path(run_ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=root))
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in masters.items()}, str(tmp / "model.safetensors"))
        opt_tensors, groups = _optimizer_tensors(optimizer)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, str(tmp / "rng.safetensors"))
        py_state = random.getstate()
        _write_json(tmp / "state.json", {**state, "step": step, "param_groups": groups,
                                          "python_rng": [py_state[0], list(py_state[1]), py_state[2]]})
        tmp.chmod(0o755)
        if final.exists():  # a stale one from an earlier run of the same name
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    latest_tmp = root / ".latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / "latest")
    _prune(root, keep=KEEP)
    return final


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resolve(path: str | Path) -> Path:
    """A step directory, or a run directory (-> its `latest`)."""
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    if (p / "latest").is_file():
        return p / (p / "latest").read_text().strip()
    raise CheckpointError(f"no checkpoint at {p}: pass a step_NNNNNN directory or a run checkpoint directory with a `latest` file")


def load(path: str | Path, device) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(state.json, master weights on `device`, optimizer state dict ready for load_state_dict)."""
    d = resolve(path)
    state = json.loads((d / "state.json").read_text())
    masters = load_file(str(d / "model.safetensors"), device=str(device))
    flat = load_file(str(d / "optimizer.safetensors"), device=str(device))
    opt_state: dict[int, dict] = {}
    for key, t in flat.items():
        i, name = key.split(".", 1)
        # AdamW keeps `step` on the CPU unless capturable/fused; restore where it was saved from
        opt_state.setdefault(int(i), {})[name] = t.cpu() if name == "step" else t
    rng = load_file(str(d / "rng.safetensors"))
    state["_rng"] = rng
    return state, masters, {"state": opt_state, "param_groups": state["param_groups"]}


def restore_rng(state: dict) -> None:
    v, internal, gauss = state["python_rng"]
    random.setstate((v, tuple(internal), gauss))
    rng = state["_rng"]
    torch.set_rng_state(rng["torch_cpu"])
    cuda = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
