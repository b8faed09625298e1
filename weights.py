"""Hugging Face Qwen3 checkpoints <-> TorchTitan state dicts: a library and a small CLI.

    python weights.py --random SHAPE [--layers N] [--seed S] [--dtype bf16|fp32] [--random-device cuda] --out DIR
        (SHAPE: tiny, small, Qwen3-0.6B ... Qwen3-32B, tiny-moe, Qwen3-30B-A3B)
    python weights.py --download REPO_ID --out DIR
    python weights.py --check DIR
    python weights.py --merge-lora ADAPTER_DIR --model BASE_DIR --out DIR [--device auto|cpu|cuda]

Every checkpoint is validated against its own config.json before use: each expected tensor must
be there with the shape the config implies, and nothing else may be. Problems raise `WeightsError`
with one line saying what is wrong and what to do; the CLI prints that line and exits with status 1
(2 for bad arguments, 6 for I/O errors; see spirl/core/errors.py), a traceback only with --debug.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from torchtitan_compat.lora import LoRAError
from torchtitan_compat.safetensors_io import save_tensors, write_safetensors
from torchtitan_compat.config import (
    SHAPES,
    ConfigError,
    ModelDir,
    hf_config_for_shape,
    model_args_from_hf_config,
    sparse_layers,
)

logger = logging.getLogger("weights")

DEFAULT_MODEL = "Qwen/Qwen3-1.7B"
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "vocab.json", "merges.txt", "*.jinja"]
# Qwen3's real generation_config.json (sampling defaults vLLM reads; eos = <|im_end|>, <|endoftext|>).
QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
}
_CONFIG_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_CLI_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class WeightsError(ValueError):
    """A checkpoint or state dict is unusable; the message is one line saying what to do."""


# ---------------------------------------------------------------------------------------------
# Expected tensors (names and shapes follow from the config alone)


def expected_hf_expert_shapes(model_args) -> dict[str, tuple[int, ...]]:
    """HF names -> shapes of the sparse layers' router and experts, as the Hub's Qwen3-MoE checkpoints and
    transformers' `save_pretrained` write them (one tensor per expert and projection)."""
    a = model_args
    shapes = {}
    for i in sparse_layers(a):
        p = f"model.layers.{i}.mlp."
        shapes[p + "gate.weight"] = (a.moe_args.num_experts, a.dim)
        for e in range(a.moe_args.num_experts):
            shapes.update({f"{p}experts.{e}.gate_proj.weight": (a.moe_inter_dim, a.dim),
                           f"{p}experts.{e}.up_proj.weight": (a.moe_inter_dim, a.dim),
                           f"{p}experts.{e}.down_proj.weight": (a.dim, a.moe_inter_dim)})
    return shapes


def expected_hf_shapes(model_args, experts: bool = True) -> dict[str, tuple[int, ...]]:
    """HF Qwen3 tensor names -> shapes, in the canonical order (embeddings, layers, norm, head). Qwen3-MoE's
    sparse layers have a router and experts (`expected_hf_expert_shapes`; left out with `experts=False`) in
    place of the dense MLP."""
    a = model_args
    d, dh, inter = a.dim, a.head_dim, a.hidden_dim
    q, kv = a.n_heads * dh, a.n_kv_heads * dh
    moe = expected_hf_expert_shapes(a) if experts else {}
    shapes = {"model.embed_tokens.weight": (a.vocab_size, d)}
    for i in range(a.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "self_attn.q_norm.weight": (dh,),
            p + "self_attn.k_norm.weight": (dh,),
            p + "post_attention_layernorm.weight": (d,),
        })
        if i in sparse_layers(a):
            shapes.update((k, v) for k, v in moe.items() if k.startswith(p))
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                           p + "mlp.down_proj.weight": (d, inter)})
    shapes["model.norm.weight"] = (d,)
    if not a.enable_weight_tying:  # tied checkpoints store the embedding once
        shapes["lm_head.weight"] = (a.vocab_size, d)
    return shapes


def expected_titan_shapes(model_args) -> dict[str, tuple[int, ...]]:
    """TorchTitan Qwen3Model state-dict names -> shapes (output.weight always, as the model has it). A Qwen3-MoE
    sparse layer's router and experts are not here: they map between the HF and the merged layout directly
    (`weights_vllm_compat`), without a TorchTitan copy."""
    a = model_args
    d, dh, inter = a.dim, a.head_dim, a.hidden_dim
    q, kv = a.n_heads * dh, a.n_kv_heads * dh
    shapes = {"tok_embeddings.weight": (a.vocab_size, d)}
    for i in range(a.n_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "attention.wq.weight": (q, d),
            p + "attention.wk.weight": (kv, d),
            p + "attention.wv.weight": (kv, d),
            p + "attention.wo.weight": (d, q),
            p + "attention.q_norm.weight": (dh,),
            p + "attention.k_norm.weight": (dh,),
        })
        if i not in sparse_layers(a):
            shapes.update({p + "feed_forward.w1.weight": (inter, d), p + "feed_forward.w2.weight": (d, inter),
                           p + "feed_forward.w3.weight": (inter, d)})
        shapes.update({p + "attention_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
    shapes["norm.weight"] = (d,)
    shapes["output.weight"] = (a.vocab_size, d)
    return shapes


def _list_some(names: list[str], limit: int = 3) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_state_dict(sd: dict, expected: dict[str, tuple[int, ...]], what: str, hint: str) -> None:
    """Raise WeightsError unless `sd` has exactly the `expected` names, shapes, and float tensors."""
    missing = [k for k in expected if k not in sd]
    if missing:
        raise WeightsError(f"{what} is missing {len(missing)} tensor(s): {_list_some(missing)}; {hint}")
    unknown = sorted(k for k in sd if k not in expected)
    if unknown:
        raise WeightsError(f"{what} has {len(unknown)} unexpected tensor(s): {_list_some(unknown)}; {hint}")
    for name, shape in expected.items():
        t = sd[name]
        if tuple(t.shape) != shape:
            raise WeightsError(
                f"{what}: {name} has shape {list(t.shape)} but the config implies {list(shape)}; {hint}"
            )
        if not t.is_floating_point():
            raise WeightsError(f"{what}: {name} has dtype {t.dtype}, expected a floating-point tensor; {hint}")


def _drop_tied_output(sd: dict, src: str, dst: str, what: str) -> dict:
    """With tied embeddings the head IS the embedding: drop `src` if present, insisting it equals `dst`."""
    if src not in sd:
        return sd
    if dst in sd and sd[src] is not sd[dst] and not torch.equal(sd[src], sd[dst]):
        raise WeightsError(
            f"{what}: config ties embeddings (tie_word_embeddings=true) but {src} differs from {dst}; "
            "set tie_word_embeddings=false in config.json or drop the separate head"
        )
    return {k: v for k, v in sd.items() if k != src}


# ---------------------------------------------------------------------------------------------
# HF <-> TorchTitan


def _adapter(model_args):
    from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

    return Qwen3StateDictAdapter(model_args, hf_assets_path=None)


def hf_to_titan(hf_sd: dict, model_args) -> dict:
    """HF Qwen3 state dict -> TorchTitan state dict (tied: output.weight is the embedding tensor). Qwen3-MoE:
    the state dict without the sparse layers' router and experts (see expected_titan_shapes)."""
    hf_sd = _drop_tied_output(hf_sd, "lm_head.weight", "model.embed_tokens.weight", "HF state dict") \
        if model_args.enable_weight_tying else hf_sd
    check_state_dict(hf_sd, expected_hf_shapes(model_args, experts=False), "HF state dict",
                     "the weights do not match the model config")
    # The adapter inserts lm_head.weight into the dict it is given when weights are tied: copy it.
    titan_sd = _adapter(model_args).from_hf(dict(hf_sd))
    check_state_dict(titan_sd, expected_titan_shapes(model_args), "converted TorchTitan state dict",
                     "this is a bug in weights.hf_to_titan")
    return titan_sd


def titan_to_hf(titan_sd: dict, model_args) -> dict:
    """TorchTitan state dict -> HF Qwen3 state dict (tied: no lm_head.weight, as HF stores it)."""
    expected = expected_titan_shapes(model_args)
    if model_args.enable_weight_tying:
        titan_sd = _drop_tied_output(titan_sd, "output.weight", "tok_embeddings.weight", "TorchTitan state dict")
        expected = {k: v for k, v in expected.items() if k != "output.weight"}
    # Validate first: the adapter silently drops names it does not know.
    check_state_dict(titan_sd, expected, "TorchTitan state dict", "the weights do not match the model config")
    hf_sd = _adapter(model_args).to_hf(dict(titan_sd))
    expected_hf = expected_hf_shapes(model_args, experts=False)
    check_state_dict(hf_sd, expected_hf, "converted HF state dict", "this is a bug in weights.titan_to_hf")
    # canonical order, so that saved files and iteration order do not depend on the input's order
    return {k: hf_sd[k] for k in expected_hf}


def hf_names_of_titan(titan_part: dict, model_args) -> dict:
    """A subset of a TorchTitan state dict (one layer, say) under its HF names, by the same adapter
    as `titan_to_hf`; every name and shape checked (the adapter silently drops names it does not
    know)."""
    expected_titan = expected_titan_shapes(model_args)
    for k, v in titan_part.items():
        if k not in expected_titan or tuple(v.shape) != tuple(expected_titan[k]):
            raise WeightsError(f"TorchTitan weights: {k} {list(v.shape)} is not a weight of this model config")
    hf = _adapter(model_args).to_hf(dict(titan_part))
    expected = expected_hf_shapes(model_args, experts=False)
    if len(hf) != len(titan_part) or any(k not in expected for k in hf):
        raise WeightsError(f"TorchTitan weights: {sorted(titan_part)} did not map one to one onto HF names "
                           "(this is a bug in weights.hf_names_of_titan)")
    return hf


# ---------------------------------------------------------------------------------------------
# Reading checkpoints


def _load_safetensors_file(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise WeightsError(f"{path} is not a readable safetensors file ({e}); re-download or regenerate it") from None


def _read_safetensors(model_dir: Path) -> dict:
    """All tensors of a checkpoint: model.safetensors, or the shards a model.safetensors.index.json lists."""
    index_path, single = model_dir / "model.safetensors.index.json", model_dir / "model.safetensors"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index_path} is not a valid safetensors index ({e!r}); re-download the checkpoint") from None
        sd: dict = {}
        for shard in sorted(set(weight_map.values())):
            if not (model_dir / shard).is_file():
                raise WeightsError(f"{model_dir / shard} (listed in {index_path.name}) is missing; re-download the checkpoint")
            part = _load_safetensors_file(model_dir / shard)
            twice = sorted(set(part) & set(sd))
            if twice:
                raise WeightsError(f"{model_dir}: tensor(s) {_list_some(twice)} appear in more than one shard")
            sd.update(part)
        unlisted = sorted(set(sd) ^ set(weight_map))
        if unlisted:
            raise WeightsError(f"{index_path} and its shards disagree on {_list_some(unlisted)}; re-download the checkpoint")
        return sd
    if single.is_file():
        return _load_safetensors_file(single)
    if list(model_dir.glob("*.safetensors")):
        raise WeightsError(f"{model_dir} has *.safetensors shards but no model.safetensors.index.json; re-download the checkpoint")
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise WeightsError(f"{model_dir} has only PyTorch .bin/.pt weights; only safetensors are supported, convert or re-download")
    raise WeightsError(f"{model_dir} has no model.safetensors; is it a Hugging Face checkpoint directory?")


def read_model_dir(model_dir: str | Path | ModelDir) -> ModelDir:
    """A checkpoint directory with its config.json read and checked (a WeightsError in one line), or
    `model_dir` itself when its config was read and checked already (a ModelDir): never twice."""
    if isinstance(model_dir, ModelDir):
        return model_dir
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise WeightsError(f"model directory {model_dir} does not exist; pass a Qwen3 checkpoint directory")
    try:
        return ModelDir.read(model_dir)
    except ConfigError as e:
        raise WeightsError(f"{model_dir}: {e}") from None


def load_hf_checkpoint(model_dir: str | Path | ModelDir) -> tuple[dict, dict]:
    """(config.json dict, HF state dict) of a validated local Qwen3 safetensors checkpoint (a
    ModelDir's config is not read again)."""
    checkpoint = read_model_dir(model_dir)
    return checkpoint.hf_config, hf_state_dict(checkpoint)


def hf_state_dict(checkpoint: ModelDir) -> dict:
    """The HF state dict of a checkpoint whose config.json was read and checked (read_model_dir),
    validated against that config."""
    model_args, model_dir = checkpoint.args, checkpoint.path
    sd = _read_safetensors(model_dir)
    # Non-learned RoPE buffers that some exporters include: nothing to load, so ignore them.
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    sd = unfuse_experts(sd, model_args)
    if model_args.enable_weight_tying:
        sd = _drop_tied_output(sd, "lm_head.weight", "model.embed_tokens.weight", str(model_dir))
    check_state_dict(sd, expected_hf_shapes(model_args), str(model_dir),
                     "the weights do not match config.json: re-download or regenerate the checkpoint")
    return sd


def unfuse_experts(sd: dict, model_args) -> dict:
    """Experts stored fused, as transformers 5 holds them in memory (`mlp.experts.gate_up_proj` [E, 2I, D] =
    cat(gate, up) per expert, `mlp.experts.down_proj` [E, D, I]; vLLM loads this form too), as the per-expert
    tensors the Hub's checkpoints have: views, no copy. Anything else is returned as it is."""
    out = dict(sd)
    for i in sparse_layers(model_args):
        p = f"model.layers.{i}.mlp.experts."
        for what in ("gate_up_proj", "down_proj"):
            t = out.pop(p + what, None)
            if t is not None and t.dim() == 3:
                out.update(per_expert_tensors(p, what, t, model_args.moe_inter_dim))
    return out


def hf_experts_to_compat(hf_sd: dict, model_args, consume: bool = False, layers=None) -> dict:
    """The sparse layers' HF router and per-expert tensors (all of them, or those of `layers`) in the merged
    layout: each layer's experts copied once into [E, 2I, D] and [E, D, I] tensors of the HF tensors' dtype.
    `consume`: each HF tensor is taken out of hf_sd once copied, so that the host holds about one copy of the
    experts at a time (Qwen3-30B-A3B: 57 GiB of bf16 experts)."""
    a, out = model_args, {}
    take = hf_sd.pop if consume else hf_sd.__getitem__
    for i in sparse_layers(a) if layers is None else layers:
        p, e_count, inter = f"model.layers.{i}.mlp.", a.moe_args.num_experts, a.moe_inter_dim
        first = hf_sd[p + "experts.0.gate_proj.weight"]
        gate_up = torch.empty((e_count, 2 * inter, a.dim), dtype=first.dtype)
        down = torch.empty((e_count, a.dim, inter), dtype=first.dtype)
        for e in range(e_count):
            gate_up[e, :inter] = take(f"{p}experts.{e}.gate_proj.weight")
            gate_up[e, inter:] = take(f"{p}experts.{e}.up_proj.weight")
            down[e] = take(f"{p}experts.{e}.down_proj.weight")
        out.update({f"layers.{i}.moe.router.weight": take(p + "gate.weight"),
                    f"layers.{i}.moe.experts.gate_up_proj": gate_up, f"layers.{i}.moe.experts.down_proj": down})
    return out


def compat_experts_to_hf(compat_part: dict, model_args) -> dict:
    """Merged-layout router and expert tensors (any subset of them) under their HF names: views, no copy."""
    out = {}
    for name, t in compat_part.items():
        layer, _, what = name.removeprefix("layers.").partition(".moe.")
        p = f"model.layers.{layer}.mlp."
        if what == "router.weight":
            out[p + "gate.weight"] = t
        else:  # experts.gate_up_proj or experts.down_proj
            out.update(per_expert_tensors(p + "experts.", what.removeprefix("experts."), t, model_args.moe_inter_dim))
    return out


def per_expert_tensors(prefix: str, what: str, t: torch.Tensor, inter: int) -> dict:
    """The per-expert HF tensors (`{prefix}{e}.gate_proj.weight`, `up_proj`, `down_proj`) of a fused [E, 2I, D]
    gate_up_proj or [E, D, I] down_proj (`what`): views, no copy."""
    if what == "gate_up_proj":
        return {k: v for e in range(t.shape[0]) for k, v in (
            (f"{prefix}{e}.gate_proj.weight", t[e, :inter]), (f"{prefix}{e}.up_proj.weight", t[e, inter:]))}
    return {f"{prefix}{e}.down_proj.weight": t[e] for e in range(t.shape[0])}


def resolve_model_dir(model: str = DEFAULT_MODEL, local_dir: str | Path | None = None) -> Path:
    """A local directory as-is (no network); otherwise download HF repo `model` and return its path."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise WeightsError(f"model directory {model} does not exist; pass an existing directory or a Hugging Face repo id like {DEFAULT_MODEL}")
    from huggingface_hub import snapshot_download

    try:
        out = snapshot_download(repo_id=model, allow_patterns=DOWNLOAD_PATTERNS,
                                local_dir=str(local_dir) if local_dir is not None else None)
    except Exception as e:  # offline, unknown repo, auth, disk...: all become one actionable line
        first_line = (str(e).strip().splitlines() or [""])[0]
        raise WeightsError(
            f"could not download {model!r} from the Hugging Face Hub ({type(e).__name__}: {first_line}); "
            "check the repo id and network access (HF_TOKEN, HF_HUB_OFFLINE), or pass a local checkpoint directory"
        ) from None
    return Path(out)


# ---------------------------------------------------------------------------------------------
# Writing random checkpoints


def random_tensor_maker(seed: int, device: str = "cpu") -> Callable[[str, tuple], torch.Tensor]:
    """Deterministic random weights drawn in a fixed order from one seeded generator on `device` (`cuda`
    draws 30B parameters in seconds where the CPU takes minutes; its values are not the CPU's).

    Matrices ~ N(0, 0.02^2); RMSNorm weights ~ 1 + 0.1 N(0, 1), so that norms are not identities
    and a conversion that mixed two norms up would change the model's output.
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def make(name: str, shape: tuple) -> torch.Tensor:
        t = torch.randn(shape, generator=gen, dtype=torch.float32, device=device)
        return t.mul_(0.1).add_(1.0) if name.endswith("norm.weight") else t.mul_(0.02)

    return make


def write_random_checkpoint(out_dir: str | Path, shape: str, num_layers: int | None = None, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16, overwrite: bool = False, device: str = "cpu",
                            config: dict | None = None) -> Path:
    """Write a complete HF-format Qwen3 checkpoint with random weights (config, generation config,
    model.safetensors, tokenizer). Same arguments -> identical tensor bytes. Written to a temporary
    directory next to `out_dir` and renamed into place, so `out_dir` is never half-written. `config`:
    config.json fields set over the shape's (e.g. {"mlp_only_layers": []}), checked as any config is."""
    from torchtitan_compat.tokenizer import save_qwen3_tokenizer

    if dtype not in _CONFIG_DTYPE_NAMES:
        raise WeightsError(f"unsupported dtype {dtype}; use one of {', '.join(map(str, _CONFIG_DTYPE_NAMES))}")
    try:
        cfg = {**hf_config_for_shape(shape, num_layers), **(config or {})}
        shapes = expected_hf_shapes(model_args_from_hf_config(cfg))
    except ConfigError as e:
        raise WeightsError(str(e)) from None
    cfg["torch_dtype"] = _CONFIG_DTYPE_NAMES[dtype]
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise WeightsError(f"{out} exists and is not a directory; choose another output path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise WeightsError(f"{out} already exists and is not empty; remove it, choose another path, or pass --force")
    n_params = sum(math.prod(s) for s in shapes.values())
    logger.info("writing random %s checkpoint (%d layers, %.2fB params, %s, seed %d) to %s",
                shape, cfg["num_hidden_layers"], n_params / 1e9, cfg["torch_dtype"], seed, out)

    with atomic_directory(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION_CONFIG, indent=2) + "\n")
        make = random_tensor_maker(seed, device)
        write_safetensors(tmp / "model.safetensors", {k: (dtype, s) for k, s in shapes.items()},
                          lambda name: make(name, shapes[name]), {"format": "pt"})
        save_qwen3_tokenizer(tmp)
    return out


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to `out`; when the block succeeds it replaces `out`
    (renamed into place), so `out` is never half-written. On an error `out` is left as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is an ordinary directory
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_hf_checkpoint(hf_sd: dict, src_dir: str | Path, out: str | Path, dtype: torch.dtype | None = torch.float32,
                       config: dict | None = None) -> Path:
    """Write an HF checkpoint: `hf_sd` as model.safetensors (in `dtype`; None keeps each tensor's)
    plus every other file of `src_dir` (config, generation config, tokenizer; not its weights),
    atomically. `config`: a config.json to write instead of src_dir's."""
    src_dir, out = Path(src_dir), Path(out)
    with atomic_directory(out) as tmp:
        for f in src_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_tensors(tmp / "model.safetensors", {k: v if dtype is None else v.detach().to(dtype)
                                                 for k, v in hf_sd.items()}, {"format": "pt"})
    return out


def merge_lora(adapter_dir: str | Path, model_dir: str | Path, out: str | Path, device: str = "auto") -> Path:
    """Write base checkpoint `model_dir` with the PEFT LoRA adapter `adapter_dir` merged in, as an
    HF checkpoint `out` in the base's dtype: each adapted weight becomes round(W + s B A) computed as
    PEFT's merge computes it (torchtitan_compat.lora.merged, the very function training merges
    with: on the GPU the bits are those the rollout engine served). An adapted lm_head of a model
    with tied embeddings is written as an untied lm_head (tie_word_embeddings false): the adapter
    changed the output projection, not the input embedding."""
    from torchtitan_compat.lora import GROUPS, expert_targets, merged
    from torchtitan_compat.peft_adapter import hf_module, param_name, read_adapter

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise WeightsError(f"{out} already exists and is not empty; remove it or choose another --out")
    cfg, hf_sd = load_hf_checkpoint(model_dir)
    args = model_args_from_hf_config(cfg)
    spec, params, _ = read_adapter(adapter_dir, args)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    untie = "lm_head" in spec.targets and args.enable_weight_tying
    experts = expert_targets(spec, args)
    out_sd = dict(hf_sd)
    for target in spec.targets:
        if experts and target in GROUPS["mlp"]:
            continue  # the experts' stacked parameters, below
        for layer in [None] if target == "lm_head" else range(args.n_layers):
            name = hf_module(target, layer) + ".weight"
            w = hf_sd["model.embed_tokens.weight"] if untie and target == "lm_head" else hf_sd[name]
            a, b = (params[param_name(target, layer, x)].to(dev) for x in "AB")
            out_sd[name] = merged(w, a, b, spec.scale, w.dtype, dev).cpu()
    if experts:
        out_sd.update(_merged_experts(out_sd, params, spec, args, experts, dev))
    if untie:
        cfg = {**cfg, "tie_word_embeddings": False}
        out_sd = {**out_sd, "lm_head.weight": out_sd.pop("lm_head.weight")}  # the head after everything else
    logger.info("merged %s (rank %d, alpha %g, %s) into %s on %s", adapter_dir, spec.rank, spec.alpha,
                ",".join(spec.targets), model_dir, dev)
    return save_hf_checkpoint(out_sd, model_dir, out, dtype=None, config=cfg)


def _merged_experts(hf_sd: dict, params: dict, spec, args, experts: tuple[str, ...], dev) -> dict:
    """The per-expert HF tensors of every sparse layer with the adapters of the `experts` parameters merged in
    (torchtitan_compat.lora_experts.merged_experts on the stacked [E, out, in] tensors)."""
    from torchtitan_compat.lora_experts import merged_experts
    from torchtitan_compat.peft_adapter import expert_param_name

    out = {}
    for i in sparse_layers(args):
        stacked = hf_experts_to_compat(hf_sd, args, layers=[i])
        for t in experts:
            key = f"layers.{i}.moe.experts.{t}"
            a, b = (params[expert_param_name(t, i, x)].to(dev) for x in "AB")
            stacked[key] = merged_experts(stacked[key], a, b, spec.scale, stacked[key].dtype, dev).cpu()
        out.update(compat_experts_to_hf(stacked, args))
    return out


# ---------------------------------------------------------------------------------------------
# CLI


def summarize(model_dir: Path, cfg: dict, sd: dict) -> str:
    """A few human-readable lines describing a validated checkpoint."""
    a = model_args_from_hf_config(cfg)
    n_params = sum(t.numel() for t in sd.values())
    dtypes = ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in sd.values()}))
    has_tok = (model_dir / "tokenizer.json").is_file()
    return "\n".join([
        f"{model_dir}: Qwen3, {a.n_layers} layers, hidden {a.dim}, heads {a.n_heads} q / {a.n_kv_heads} kv x {a.head_dim}, "
        f"intermediate {a.hidden_dim}, vocab {a.vocab_size}, {'tied' if a.enable_weight_tying else 'untied'} embeddings",
        *([f"mixture of experts: {len(sparse_layers(a))} sparse layers, {a.moe_args.num_experts} experts of width "
           f"{a.moe_inter_dim}, top-{a.moe_args.top_k}, {'renormalized' if a.moe_args.route_norm else 'unnormalized'} "
           "routing weights"] if sparse_layers(a) else []),
        f"tensors: {len(sd)}, parameters: {n_params:,} ({n_params / 1e9:.3f}B), dtype: {dtypes}",
        f"tokenizer: {'tokenizer.json present' if has_tok else 'MISSING (no tokenizer.json)'}",
        "OK",
    ])


class _OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _OneLineArgumentParser(prog="weights.py", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--random", metavar="SHAPE", choices=list(SHAPES),
                      help=f"write a random checkpoint of this shape: {', '.join(SHAPES)}")
    mode.add_argument("--download", metavar="REPO_ID", help=f"download a Hugging Face repo (e.g. {DEFAULT_MODEL})")
    mode.add_argument("--check", metavar="DIR", help="load and validate a checkpoint directory, print a summary")
    mode.add_argument("--merge-lora", metavar="ADAPTER_DIR",
                      help="merge a PEFT LoRA adapter into --model, writing an HF checkpoint to --out")
    p.add_argument("--out", metavar="DIR", help="output directory for --random / --download / --merge-lora")
    p.add_argument("--model", metavar="DIR", help="--merge-lora: the base checkpoint the adapter was trained on")
    p.add_argument("--device", default="auto", help="--merge-lora: where to merge: auto (cuda if present), cpu, cuda")
    p.add_argument("--layers", type=int, help="--random: number of layers (default: the shape's)")
    p.add_argument("--seed", type=int, default=0, help="--random: generator seed (default 0)")
    p.add_argument("--dtype", choices=list(_CLI_DTYPES), default="bf16", help="--random: weight dtype (default bf16)")
    p.add_argument("--force", action="store_true", help="--random: replace a non-empty --out directory")
    p.add_argument("--random-device", choices=("cpu", "cuda"), default="cpu",
                   help="--random: draw the weights on this device (cuda: seconds for Qwen3-30B-A3B, other values "
                        "than the CPU's; default cpu)")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error (also SPIRL_DEBUG=1)")
    return p


# Exit statuses as in spirl/core/errors.py (weights.py sits below spirl in the import layering, so it
# cannot import that module; tests/test_error_matrix.py checks that the shared numbers agree),
# except that an unusable checkpoint keeps the status 1 this CLI has always had (spirl: 3).
EXIT_CHECKPOINT, EXIT_USAGE, EXIT_IO, EXIT_BUG, EXIT_SIGINT = 1, 2, 6, 70, 130


def main(argv: list[str] | None = None) -> int:
    """Errors: one line on stderr, status 1 (an unusable checkpoint or a failed download), 2
    (arguments), 6 (I/O), 130 (Ctrl-C), 70 (a bug: the traceback is printed, as for every error
    with --debug or SPIRL_DEBUG=1)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.random or args.download or args.merge_lora) and not args.out:
        parser.error("--out DIR is required with --random, --download and --merge-lora")
    if args.merge_lora and not args.model:
        parser.error("--merge-lora needs --model BASE_DIR, the checkpoint the adapter was trained on")
    debug = args.debug or os.environ.get("SPIRL_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    def fail(message: str, code: int, e: BaseException) -> int:
        if debug or code == EXIT_BUG:
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        print(f"weights.py: error: {' '.join(message.split())}", file=sys.stderr)
        return code

    try:
        if args.random:
            model_dir = write_random_checkpoint(args.out, args.random, num_layers=args.layers, seed=args.seed,
                                                dtype=_CLI_DTYPES[args.dtype], overwrite=args.force,
                                                device=args.random_device)
        elif args.download:
            model_dir = resolve_model_dir(args.download, local_dir=args.out)
        elif args.merge_lora:
            model_dir = merge_lora(args.merge_lora, args.model, args.out, args.device)
        else:
            model_dir = Path(args.check)
        cfg, sd = load_hf_checkpoint(model_dir)
    except (WeightsError, ConfigError, LoRAError) as e:
        return fail(str(e), EXIT_CHECKPOINT, e)
    except OSError as e:
        where = f" {e.filename}" if e.filename else ""
        return fail(f"cannot read or write{where} ({e.strerror or e}); check the path, its permissions and the "
                    "free disk space", EXIT_IO, e)
    except KeyboardInterrupt as e:
        return fail("interrupted (a checkpoint being written is not left half-written)", EXIT_SIGINT, e)
    except Exception as e:  # noqa: BLE001 - a bug: traceback, then one line
        first = (str(e).strip().splitlines() or [""])[0]
        return fail(f"internal error (a bug): {type(e).__name__}: {first}; please report it with the traceback above",
                    EXIT_BUG, e)
    print(summarize(model_dir, cfg, sd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
