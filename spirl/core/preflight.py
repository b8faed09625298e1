"""Checks before a run, cheapest first, each failing in one line (spirl.core.errors): the model
directory validated from config.json and the safetensors headers alone, the tokenizer, prompt
lengths against the engine's max_model_len, a --resume checkpoint against this model and this
reference policy, and the memory plan on CUDA. spirl/loops/run.py calls them in its setup order."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .config import TrainConfig
from .errors import EXIT_ENVIRONMENT, EXIT_USAGE, UserError

log = logging.getLogger("spirl.core.preflight")


class ModelError(ValueError):
    """--model is unusable; one line saying what to do."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: torch sees no CUDA GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES); "
                            "use --device cpu", EXIT_ENVIRONMENT)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible",
                            EXIT_ENVIRONMENT)
    return device


def resolve_model(model: str, checkpoint_dir: str) -> Path:
    """A local dir, an HF repo id (downloaded), or `random:<shape>` (written once, deterministic)."""
    import weights

    if model.startswith("random:"):
        shape = model.split(":", 1)[1]
        out = Path(checkpoint_dir) / "models" / f"random-{shape}"
        if not (out / "config.json").is_file():
            try:
                weights.write_random_checkpoint(out, shape, seed=0, dtype=torch.float32, overwrite=True)
            except weights.WeightsError as e:
                raise ModelError(f"--model {model}: {e}") from None
        return out
    try:
        return weights.resolve_model_dir(model)
    except weights.WeightsError as e:
        raise ModelError(f"--model: {e}") from None


# -- the checkpoint, validated before anything reads it ------------------------------------------


class _Header:
    """A tensor as a safetensors header describes it (what weights.check_state_dict looks at)."""

    def __init__(self, shape, dtype: str):
        self.shape, self.dtype = tuple(shape), dtype

    def is_floating_point(self) -> bool:
        return self.dtype.startswith(("F", "BF"))


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files (the rules of weights.load_hf_checkpoint)."""
    index, single = model_dir / "model.safetensors.index.json", model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise ModelError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e}); "
                             "re-download the checkpoint") from None
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ModelError(f"{model_dir / missing[0]} (listed in {index.name}) is missing; "
                             "re-download the checkpoint")
        return [model_dir / s for s in shards]
    if single.is_file():
        return [single]
    if list(model_dir.glob("*.safetensors")):
        raise ModelError(f"{model_dir} has *.safetensors shards but no model.safetensors.index.json; "
                         "re-download the checkpoint")
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise ModelError(f"{model_dir} has only PyTorch .bin/.pt weights; only safetensors are supported: "
                         "convert them (save_pretrained(..., safe_serialization=True)) or re-download")
    raise ModelError(f"{model_dir} has no model.safetensors; pass a Hugging Face checkpoint directory "
                     "(config.json, model.safetensors, tokenizer.json) or re-download it")


def validate_model_dir(model_dir: str | Path):
    """(config.json dict, torchtitan model args) of a checkpoint directory whose config is a
    supported Qwen3 and whose safetensors headers hold exactly the tensors that config implies
    (names, shapes, float dtypes; a truncated file fails here too). Reads no tensor data, so it is
    cheap for any size; weights.load_hf_checkpoint checks the rest when the model is loaded."""
    import weights
    from safetensors import SafetensorError, safe_open
    from torchtitan_compat.config import ConfigError, load_hf_config, model_args_from_hf_config

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"model directory {model_dir} does not exist; pass a Qwen3 checkpoint directory")
    if not (model_dir / "config.json").is_file():
        present = sorted(p.name for p in model_dir.iterdir())[:3]
        holds = f"it holds only {', '.join(present)}" if present else "it is empty"
        raise ModelError(f"{model_dir} is not a checkpoint: config.json is missing ({holds}); pass a Hugging Face "
                         "Qwen3 checkpoint directory (config.json, model.safetensors, tokenizer.json), a Hub repo id, "
                         "or random:tiny")
    try:
        hf_config = load_hf_config(model_dir)
        args = model_args_from_hf_config(hf_config)
    except ConfigError as e:
        raise ModelError(f"{model_dir}: {e} (fix its config.json or pass another Qwen3 checkpoint)") from None
    headers: dict[str, _Header] = {}
    for path in _safetensors_files(model_dir):
        try:
            with safe_open(str(path), "pt") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    headers[name] = _Header(s.get_shape(), s.get_dtype())
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{path} is not a readable safetensors file ({' '.join(str(e).split())}); "
                             "re-download or regenerate it") from None
    headers = {k: v for k, v in headers.items() if not k.endswith("rotary_emb.inv_freq")}
    if args.enable_weight_tying:  # a separate head must equal the embedding: checked when loaded
        headers.pop("lm_head.weight", None)
    try:
        weights.check_state_dict(headers, weights.expected_hf_shapes(args), str(model_dir),
                                 "the weights do not match config.json: re-download or regenerate the checkpoint")
    except weights.WeightsError as e:
        raise ModelError(str(e)) from None
    return hf_config, args


def model_fingerprint(model_dir: str | Path) -> str:
    """A cheap identity of a checkpoint's weights: config.json, and per safetensors file its name,
    size, header and 32 slices of 64 KiB spread over its data (about 2 MiB read per file, whatever
    its size). Two checkpoints of one shape but different weights differ in it."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(n, size)))
            start = 8 + n
            for i in range(32):
                f.seek(start + (size - start) * i // 32)
                h.update(f.read(1 << 16))
    return h.hexdigest()[:16]


def load_checked_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer; any failure is one line (ModelError)."""
    from torchtitan_compat.tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(model_dir)
    except TokenizerError as e:
        raise ModelError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise many kinds on a bad tokenizer file
        first = (str(e).strip().splitlines() or [""])[0]
        raise ModelError(f"{model_dir}: the tokenizer cannot be loaded ({type(e).__name__}: {first}); re-download "
                         "the checkpoint or rewrite it with torchtitan_compat.tokenizer.save_qwen3_tokenizer") from e


# -- prompts against the engine's context length ------------------------------------------------------


def engine_max_model_len(cfg: TrainConfig, model_args) -> tuple[int, str]:
    """(longest prompt + completion the engine takes, where that limit comes from)."""
    limit, source = getattr(cfg, "max_model_len", None), "--max-model-len"
    if limit is None and cfg.engine == "vllm":
        from ..engines.vllm_engine import VLLMEngineConfig

        limit, source = VLLMEngineConfig.max_model_len, "the vLLM engine's max_model_len"
    if limit is None or model_args.max_seq_len < limit:
        limit, source = model_args.max_seq_len, "the model's max_position_embeddings"
    return int(limit), source


def _too_long(cfg: TrainConfig, prompt_len: int, limit: int, source: str, what: str) -> UserError:
    room = limit - prompt_len
    fix = f"lower --max-new-tokens to {room}" if room >= 1 else "use shorter prompts"
    if source == "--max-model-len":
        fix += f" or raise --max-model-len to {prompt_len + cfg.max_new_tokens}"
    return UserError(f"{what} has {prompt_len} tokens; with --max-new-tokens {cfg.max_new_tokens} that is "
                     f"{prompt_len + cfg.max_new_tokens} > {limit} ({source}): {fix}", EXIT_USAGE)


def check_prompt_lengths(task, cfg: TrainConfig, limit: int, source: str) -> int | None:
    """The longest prompt of the task's fixed prompt pool (its first turn, for multi-turn tasks),
    refused if it + max_new_tokens exceeds `limit`; None when the task's prompts are not known."""
    pool = getattr(task, "pool", None)
    if not isinstance(pool, list) or not pool:
        return None
    longest = max(len(ids) for ids, _ in pool)
    if longest + cfg.max_new_tokens > limit:
        raise _too_long(cfg, longest, limit, source, f"the longest prompt of --task {cfg.task}")
    return longest


class LengthCheckedEngine:
    """The engine, with every generate call's prompts checked against its context length first
    (for tasks whose prompts are not known at start): a one-line error instead of the engine's."""

    def __init__(self, engine, cfg: TrainConfig, limit: int, source: str):
        self._engine, self._cfg, self._limit, self._source = engine, cfg, limit, source

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompts, *args, **kwargs):
        max_tokens = kwargs.get("max_tokens", args[1] if len(args) > 1 else self._cfg.max_new_tokens)
        for p in prompts:
            if len(p) + max_tokens > self._limit:
                raise _too_long(self._cfg, len(p), self._limit, self._source, "a prompt of this step")
        return self._engine.generate(prompts, *args, **kwargs)


# -- checkpoints and resume ------------------------------------------------------------------------


def check_resume(path: str, model_args, reference: dict, lora=None) -> ckpt.CheckpointInfo:
    """The --resume checkpoint is readable, holds this model's tensors (with `lora`, a LoRASpec:
    this run's adapters), and its run started from the same model (so the reference policy is the
    one the run began with)."""
    from weights_vllm_compat import expected_compat_shapes

    info = ckpt.inspect(path)
    then = info.state.get("reference") or {}
    used = then.get("model") or info.state.get("config", {}).get("model") or info.state.get("model_dir", "?")
    if info.lora != (lora is not None):
        kinds = ("a LoRA", "a full fine-tuning") if info.lora else ("a full fine-tuning", "a LoRA")
        raise ckpt.CheckpointError(f"--resume {info.path} is {kinds[0]} checkpoint but this is {kinds[1]} run; "
                                   "resume with the LoRA flags (--lora-rank, ...) that run used")
    if lora is not None:
        from torchtitan_compat.peft_adapter import expected_params

        expected = expected_params(lora, model_args)
    else:
        expected = expected_compat_shapes(model_args)
    missing = [k for k in expected if k not in info.shapes]
    unknown = [k for k in info.shapes if k not in expected]
    wrong = [k for k in expected if k in info.shapes and tuple(info.shapes[k]) != tuple(expected[k])]
    if missing or unknown or wrong:
        if wrong:
            k = wrong[0]
            detail = f"{k} is {list(info.shapes[k])} there but {list(expected[k])} in --model {reference['model']}"
        else:
            detail = (f"{len(missing)} tensor(s) of --model {reference['model']} are missing "
                      f"({', '.join(missing[:2])}) and {len(unknown)} are unknown ({', '.join(unknown[:2])})")
        flags = " and LoRA flags (--lora-rank, --lora-targets)" if lora is not None else ""
        raise ckpt.CheckpointError(f"--resume {info.path} was written for another model ({detail}); resume with the "
                                   f"--model{flags} that run used ({used})")
    moments = Counter(tuple(s) for k, s in info.optimizer_shapes.items() if k.endswith((".exp_avg", ".exp_avg_sq")))
    if moments - Counter(tuple(s) for s in expected.values() for _ in range(2)):  # AdamW: 2 moments per parameter
        raise ckpt.CheckpointError(f"--resume {info.path}: optimizer.safetensors does not match its "
                                   "model.safetensors (a mixed-up checkpoint); pass an earlier checkpoint")
    if not then:
        log.warning("%s records no reference model: cannot check that --model is the one the run started with",
                    info.path)
    elif then.get("fingerprint") != reference["fingerprint"]:
        raise ckpt.CheckpointError(
            f"--resume {info.path}: that run started from --model {then.get('model')} ({then.get('model_dir')}), "
            f"but --model {reference['model']} ({reference['model_dir']}) has other weights or config, so the "
            f"reference policy would change; resume with --model {then.get('model')}")
    return info


def check_memory(cfg: TrainConfig, model_args, device: torch.device, max_seq_len: int, shards: int = 0,
                 lora=None) -> None:
    """The memory plan on this GPU; `shards`: the ranks FSDP2 shards over (0: not sharded); `lora`:
    the run's LoRASpec (None: full fine-tuning)."""
    import batch_invariant_backward as bib

    from . import memory_plan

    props = torch.cuda.get_device_properties(device)
    est = memory_plan.check(model_args, cfg, props.total_memory, f"{device} ({props.name})", max_seq_len=max_seq_len,
                            logits_chunk_elements=getattr(bib, "LOGITS_CHUNK_ELEMENTS", None), shards=shards,
                            lora=lora)
    log.info("memory plan: about %.1f of %.1f GiB (%s)", est.total / memory_plan.GIB,
             props.total_memory / memory_plan.GIB, est.summary())
    host = host_memory_bytes()
    if host:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        est = memory_plan.check_host(model_args, cfg, host, local, lora, shards)
        log.info("host memory plan: about %.1f of %.1f GiB at the peak, %d rank(s) of this host (%s)",
                 est.total / memory_plan.GIB, host / memory_plan.GIB, local, est.summary())


def host_memory_bytes() -> int | None:
    """The host's memory (MemTotal of /proc/meminfo); None where that file does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
