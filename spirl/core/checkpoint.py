"""Atomic training checkpoints: fp32 master weights, AdamW state, step, RNG states.

Layout under <checkpoint_dir>/<run_name>/:
    step_000010/model.safetensors       fp32 master weights (compat names); with LoRA instead:
    step_000010/adapter_config.json     the adapters as a PEFT adapter (what PEFT and vLLM load;
    step_000010/adapter_model.safetensors   float32, PEFT's tensor names: torchtitan_compat.peft_adapter)
    step_000010/optimizer.safetensors   AdamW per-parameter tensors (exp_avg, exp_avg_sq, step)
    step_000010/rng.safetensors         torch CPU (and this process's CUDA) generator states
    step_000010/state.json              step, config, param_groups, python RNG state
    latest                              name of the newest complete step directory

A step directory is written under a temporary name and renamed into place (atomic on one
filesystem); `latest` is then replaced with os.replace. A crash at any point leaves the previous
checkpoint intact and `latest` pointing to it; a write that fails (a full disk) removes the
temporary directory and says so in one line (exit status 6). The newest KEEP complete checkpoints
are kept. Equal state is equal bytes, file for file (a resumed run's checkpoint is the uninterrupted
run's): safetensors written by torchtitan_compat.safetensors_io, JSON with sorted keys, no times;
what differs between the two runs (--resume, --steps, the run's paths) is recorded in the run's
logs, not here (spirl.core.config.RUN_ONLY_FIELDS). Everything is loaded with safetensors / JSON (no pickle); a checkpoint that cannot be
read (truncated, missing files, not JSON) is a CheckpointError naming the file, found by
`inspect` from the headers alone before anything is loaded.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from torchtitan_compat.safetensors_io import save_tensors

KEEP = 2


class CheckpointError(ValueError):
    """A checkpoint is missing or unusable; one line saying what to do."""


def _write_json(path: Path, obj) -> None:
    """Keys sorted: equal contents, equal bytes."""
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous()


def optimizer_tensors(opt: torch.optim.Optimizer, whole=_cpu) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """AdamW's per-parameter tensors as {"<param index>.<name>": tensor} and its param groups.
    `whole` turns each state tensor into the CPU tensor to save (sharded training: a gather)."""
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": whole(v) for i, st in sd["state"].items() for k, v in st.items()}
    return tensors, sd["param_groups"]


def save(run_ckpt_dir: str | Path, step: int, masters: dict[str, torch.Tensor],
         optimizer: torch.optim.Optimizer | tuple[dict, list], state: dict, adapter=None, extra=None) -> Path:
    """Write checkpoint `step` atomically; returns its directory. `optimizer`: the optimizer, or
    what `optimizer_tensors` made of it. `adapter`: for LoRA, a function writing the masters as a
    PEFT adapter into a directory (instead of model.safetensors). `extra`: a function writing more files
    into the directory (the rollouts --off-policy-steps sampled ahead). On an OSError (a full disk, no
    permission) nothing of this step is left behind, `latest` and the earlier checkpoints are as
    they were, and a one-line UserError (exit status 6) says so."""
    root = Path(run_ckpt_dir)
    final = root / f"step_{step:06d}"
    try:
        write_dir(final, masters, optimizer, {**state, "step": step}, adapter, extra)
        latest_tmp = root / ".latest.tmp"
        try:
            latest_tmp.write_text(final.name + "\n")
            os.replace(latest_tmp, root / "latest")
        except OSError:
            shutil.rmtree(final, ignore_errors=True)  # `latest` still names the previous one: drop this one
            raise
        finally:
            latest_tmp.unlink(missing_ok=True)
    except OSError as e:
        from .errors import EXIT_IO, UserError

        previous = _latest_name(root)
        why = f"{e.strerror or e}: {e.filename}" if e.filename else f"{e.strerror or e}"
        fix = "free disk space" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "fix the permissions"
        then = (f"the previous checkpoint {root / previous} is intact; {fix} or pass another --checkpoint-dir, "
                f"then continue with --resume {root}") if previous else \
            f"no earlier checkpoint exists; {fix} or pass another --checkpoint-dir"
        raise UserError(f"could not write checkpoint {final} ({why}); nothing of it was kept, {then}", EXIT_IO) from e
    _prune(root, keep=KEEP)
    return final


def write_dir(final: Path, masters: dict[str, torch.Tensor], optimizer, state: dict, adapter=None,
              extra=None) -> Path:
    """Write one checkpoint directory `final` (masters or adapter, optimizer, RNG states, state.json, and what
    `extra` writes) atomically: into a temporary directory beside it, renamed into place (replacing a stale
    one). OSErrors propagate; nothing half-written is left."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=final.parent))
    try:
        if adapter is not None:
            adapter(tmp)
        else:
            save_tensors(tmp / "model.safetensors", masters)
        opt_tensors, groups = optimizer if isinstance(optimizer, tuple) else optimizer_tensors(optimizer)
        save_tensors(tmp / "optimizer.safetensors", opt_tensors)
        if extra is not None:
            extra(tmp)
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # the GPU this process computes on
            rng["torch_cuda"] = torch.cuda.get_rng_state()
        save_tensors(tmp / "rng.safetensors", rng)
        py_state = random.getstate()
        _write_json(tmp / "state.json", {**state, "param_groups": groups,
                                          "python_rng": [py_state[0], list(py_state[1]), py_state[2]]})
        tmp.chmod(0o755)
        if final.exists():  # a stale one from an earlier run of the same name
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _latest_name(root: Path) -> str | None:
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        return None
    return name if name and (root / name / "state.json").is_file() else None


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
        name = (p / "latest").read_text().strip()
        if not (p / name / "state.json").is_file():
            raise CheckpointError(f"{p / 'latest'} names {name!r}, which is not a complete checkpoint; pass one of "
                                  f"the step_NNNNNN directories in {p} to --resume")
        return p / name
    if p.is_dir() and any(p.glob("step_*")):
        raise CheckpointError(f"{p} has no `latest` file; pass one of its step_NNNNNN directories to --resume")
    raise CheckpointError(f"no checkpoint at {p}: pass a step_NNNNNN directory or a run checkpoint directory "
                          "with a `latest` file")


FILES = ("state.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _weights_file(d: Path) -> str:
    """The file holding a checkpoint's masters: the PEFT adapter's weights for LoRA runs."""
    return ADAPTER_WEIGHTS if (d / ADAPTER_CONFIG).is_file() else "model.safetensors"


def _adapter_names(tensors: dict, d: Path) -> dict:
    """A LoRA checkpoint's tensors under the model's parameter names (PEFT names in the file; the experts' keys
    are read with the adapter config's target_parameters)."""
    from torchtitan_compat.peft_adapter import adapted_experts, param_of_peft_key

    try:
        experts = adapted_experts(json.loads((d / ADAPTER_CONFIG).read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise _unusable(d, f"{ADAPTER_CONFIG} is not a valid adapter config ({e})") from None
    return {param_of_peft_key(k, experts) or k: v for k, v in tensors.items()}


@dataclass
class CheckpointInfo:
    path: Path
    state: dict
    """state.json as written (step, config, param_groups, reference, ...)."""
    shapes: dict[str, tuple[int, ...]]
    """Master weight names -> shapes, from model.safetensors' header."""
    optimizer_shapes: dict[str, tuple[int, ...]]
    lora: bool = False
    """The masters are LoRA adapters (a PEFT adapter), not model weights."""


def _unusable(d: Path, what: str) -> CheckpointError:
    earlier = sorted(p.name for p in d.parent.glob("step_*") if p.is_dir() and p != d)
    hint = f"pass an earlier one ({', '.join(earlier)})" if earlier else "start the run without --resume"
    return CheckpointError(f"checkpoint {d} is unusable: {what}; {hint}")


def _header_shapes(d: Path, name: str) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(d / name), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError) as e:
        raise _unusable(d, f"{name} is not a readable safetensors file ({' '.join(str(e).split())})") from None


def inspect(path: str | Path) -> CheckpointInfo:
    """Check a checkpoint can be read, from its files' headers alone (nothing is loaded)."""
    d = resolve(path)
    weights_file = _weights_file(d)
    missing = [f for f in (weights_file if f == "model.safetensors" else f for f in FILES) if not (d / f).is_file()]
    if missing:
        raise _unusable(d, f"{', '.join(missing)} missing")
    try:
        state = json.loads((d / "state.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _unusable(d, f"state.json is not valid JSON ({e})") from None
    needed = [k for k in ("step", "param_groups", "python_rng") if k not in (state if isinstance(state, dict) else {})]
    if needed:
        raise _unusable(d, f"state.json lacks {', '.join(needed)}")
    lora = weights_file == ADAPTER_WEIGHTS
    shapes = _header_shapes(d, weights_file)
    if lora:
        shapes = _adapter_names(shapes, d)
    optimizer_shapes = _header_shapes(d, "optimizer.safetensors")
    _header_shapes(d, "rng.safetensors")
    return CheckpointInfo(d, state, shapes, optimizer_shapes, lora)


def _read(path: Path, device, rows) -> dict[str, torch.Tensor]:
    """A safetensors file; with `rows` (name -> dim-0 slice or None), only those rows of each
    tensor are read from disk."""
    if rows is None:
        return load_file(str(path), device=str(device))
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), "pt", device=str(device)) as f:
        for k in f.keys():
            sl = rows(k)
            out[k] = f.get_tensor(k) if sl is None else f.get_slice(k)[sl]
    return out


def load(path: str | Path, device, rows=None) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(state.json, master weights on `device`, optimizer state dict ready for load_state_dict).
    `rows(key)`: for sharded training, the dim-0 rows of each saved tensor this process holds (None
    = all); keys are the weight names and "<param index>.<state name>"."""
    from safetensors import SafetensorError

    info = inspect(path)
    d = info.path
    try:
        state = json.loads((d / "state.json").read_text())
        if info.lora:
            masters = _adapter_names(_read(d / ADAPTER_WEIGHTS, device, None), d)
        else:
            masters = _read(d / "model.safetensors", device, rows)
        flat = _read(d / "optimizer.safetensors", device, rows)
        opt_state: dict[int, dict] = {}
        for key, t in flat.items():
            i, name = key.split(".", 1)
            # AdamW keeps `step` on the CPU unless capturable/fused; restore where it was saved from
            opt_state.setdefault(int(i), {})[name] = t.cpu() if name == "step" else t
        rng = load_file(str(d / "rng.safetensors"))
    except (SafetensorError, OSError, ValueError) as e:
        raise _unusable(d, f"{type(e).__name__}: {' '.join(str(e).split())}") from None
    state["_rng"] = rng
    return state, masters, {"state": opt_state, "param_groups": state["param_groups"]}


def restore_rng(state: dict) -> str | None:
    """Restore the Python and torch generators; returns one line on what could not be restored (else None).

    A checkpoint holds the CPU generator and the CUDA generator of the GPU its writer computed on
    (`torch_cuda`; checkpoints before 2026-11-26: `torch_cuda_<i>` of every GPU the writer saw, i.e.
    of N GPUs under torchrun). The CUDA state is restored onto this process's GPU when there is one;
    the states of other GPUs are not, and need not be: no sample or update depends on a CUDA
    generator (vLLM's requests carry their own seeds, the trainer draws no random numbers on the GPU),
    so a checkpoint resumes on any number of GPUs, or on none, with the same samples."""
    v, internal, gauss = state["python_rng"]
    random.setstate((v, tuple(internal), gauss))
    rng = state["_rng"]
    torch.set_rng_state(rng["torch_cpu"])
    cuda = {k: t for k, t in rng.items() if k.startswith("torch_cuda")}
    if not cuda:
        return None
    if not torch.cuda.is_available():
        restored = None
    else:
        mine = "torch_cuda" if "torch_cuda" in cuda else f"torch_cuda_{torch.cuda.current_device()}"
        restored = mine if mine in cuda else None
        if restored:
            torch.cuda.set_rng_state(cuda[restored])
    left = len(cuda) - (restored is not None)
    if not left:
        return None
    where = "this process has no GPU" if not torch.cuda.is_available() else \
        f"this process computes on GPU {torch.cuda.current_device()} only"
    return (f"{left} of the checkpoint's {len(cuda)} CUDA generator state(s) not restored ({where}); no sample "
            "depends on them: vLLM's requests carry their own seeds and the trainer draws no random numbers on "
            "the GPU")
