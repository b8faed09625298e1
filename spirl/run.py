"""One GRPO run: setup, the step loop, checkpoints and resume (the step itself: spirl/trainer.py).

Setup order: cheap checks first, so that a bad setup fails in one line (spirl.errors) before
anything heavy is loaded:
  1. the config (spirl.config); --out-dir and --checkpoint-dir writable;
  2. --engine vllm: VLLM_BATCH_INVARIANT=1, vLLM importable at the pinned version;
  3. the model resolved (a local directory, a Hub repo id, or `random:<shape>`) and validated from
     config.json and the safetensors headers alone (`validate_model_dir`: no tensor is read), so
     an empty directory is reported as a missing checkpoint, not as a missing tokenizer;
  4. --resume: the checkpoint readable, written for this model (shapes), and its run started from
     this very model (the reference policy: `model_fingerprint`);
  5. the trainer's device: CUDA present for --engine vllm or --device cuda;
  6. the tokenizer and the task; every known prompt + --max-new-tokens within the engine's
     max_model_len (tasks whose prompts are not known up front: checked per generate call);
  7. on CUDA: the memory plan (spirl.memory_plan) refuses a run that would not fit;
  8. the policy (fp32 masters, compute model, reference), the engine (which gets the trainer's
     exact weights), then steps.
Metrics: one TensorBoard scalar set and one metrics.jsonl line per step (spirl.metrics);
checkpoints every `checkpoint_every` steps and after the last (spirl.checkpoint).
Interrupts: SIGINT and SIGTERM stop the run where it is (logging a step and writing a checkpoint
finish first); the logs are flushed, no partial checkpoint is left, and the one line says which
--resume continues the run (exit status 128 + the signal number).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import signal
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import trainer
from .config import TrainConfig, to_dict
from .errors import EXIT_ENVIRONMENT, EXIT_USAGE, UserError
from .evaluation import evaluate
from .metrics import MetricsLogger
from .trainer import Policy

log = logging.getLogger("spirl.run")

_NATIVE = "; on a machine without vLLM/CUDA use --engine native --dtype float32"


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
        from .engines.vllm_engine import VLLMEngineConfig

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


def save_checkpoint(cfg: TrainConfig, policy: Policy, step: int, model_dir: Path,
                    reference: dict | None = None) -> Path:
    state = {"config": to_dict(cfg), "model_dir": str(model_dir)}
    if reference is not None:
        state["reference"] = reference
    path = ckpt.save(Path(cfg.checkpoint_dir) / cfg.run_name, step, policy.masters, policy.optimizer, state)
    log.info("checkpoint: %s", path)
    return path


def check_resume(path: str, model_args, reference: dict) -> ckpt.CheckpointInfo:
    """The --resume checkpoint is readable, holds this model's tensors, and its run started from
    the same model (so the reference policy is the one the run began with)."""
    from weights_vllm_compat import expected_compat_shapes

    info = ckpt.inspect(path)
    then = info.state.get("reference") or {}
    used = then.get("model") or info.state.get("config", {}).get("model") or info.state.get("model_dir", "?")
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
        raise ckpt.CheckpointError(f"--resume {info.path} was written for another model ({detail}); resume with the "
                                   f"--model that run used ({used})")
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


def resume_into(policy: Policy, path: str, device) -> int:
    state, masters, opt_state = ckpt.load(path, device)
    d = ckpt.resolve(path)
    with torch.no_grad():
        for name, p in policy.masters.items():
            if name not in masters or masters[name].shape != p.shape:
                raise ckpt.CheckpointError(f"--resume {d}: {name} does not match the model; resume with the "
                                           "--model that run used")
            p.copy_(masters[name])
    try:
        policy.optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise ckpt.CheckpointError(f"--resume {d}: its optimizer state does not fit this run "
                                   f"({' '.join(str(e).split())}); pass another checkpoint") from None
    for group in policy.optimizer.param_groups:
        for p in group["params"]:
            for k in ("exp_avg", "exp_avg_sq"):
                t = policy.optimizer.state.get(p, {}).get(k)
                if t is not None and t.shape != p.shape:
                    raise ckpt.CheckpointError(f"--resume {d}: its optimizer state has shape {list(t.shape)} for a "
                                               f"parameter of shape {list(p.shape)}; pass another checkpoint")
    policy.push_masters_to_model()
    ckpt.restore_rng(state)
    log.info("resumed from %s at step %d", d, state["step"])
    return int(state["step"])


# -- interrupts -----------------------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (`signum`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Signals:
    """SIGINT and SIGTERM raise Interrupted: at once, or inside `deferred()` when the block ends
    (a second signal meanwhile raises at once). Installed only in the main thread; restored on exit."""

    def __init__(self):
        self.depth, self.pending, self.previous = 0, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if self.depth and self.pending is None:
            self.pending = signum
            return
        raise Interrupted(signum)

    @contextmanager
    def deferred(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)


def _interrupted(e: KeyboardInterrupt, cfg: TrainConfig, progress: dict) -> UserError:
    signum = getattr(e, "signum", signal.SIGINT)
    step, done = progress.get("step"), progress.get("done")
    if step is None:
        where = "during setup"
    elif done == step:
        where = f"after step {step}; the logs are flushed"
    else:
        where = f"during step {step} (not logged, not saved); the logs are flushed"
    root = Path(cfg.checkpoint_dir) / cfg.run_name
    try:
        latest = ckpt.resolve(root)
    except ckpt.CheckpointError:
        latest = None
    if latest is not None:
        how = f"the last checkpoint is {latest}: continue with --resume {root}"
    elif cfg.resume:
        how = f"no new checkpoint was written: continue with --resume {cfg.resume}"
    else:
        how = "no checkpoint was written yet: start the run again"
    return UserError(f"interrupted by {signal.Signals(signum).name} {where}; {how}", 128 + signum)


# -- the run --------------------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> list[dict]:
    """Run cfg.steps GRPO steps; returns the per-step metrics (also logged)."""
    progress: dict = {"step": None, "done": None}
    with _Signals() as signals:
        try:
            return _train(cfg, signals, progress)
        except KeyboardInterrupt as e:
            raise _interrupted(e, cfg, progress) from None


def _train(cfg: TrainConfig, signals: _Signals, progress: dict) -> list[dict]:
    from .errors import require_batch_invariant, require_cuda, require_vllm, require_writable_dir
    from .tasks import get_task

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.top_k != -1 or cfg.top_p != 1.0:
        log.warning("--top-k/--top-p truncate the sampling distribution, but the trainer's logprobs are of the raw "
                    "logits (--logprobs raw): the trained policy is not the one that sampled (off-policy)")
    run_dir = Path(cfg.out_dir) / cfg.run_name
    require_writable_dir(run_dir, "--out-dir")
    require_writable_dir(Path(cfg.checkpoint_dir) / cfg.run_name, "--checkpoint-dir")
    if cfg.engine == "vllm":
        require_batch_invariant(_NATIVE)
        require_vllm(_NATIVE)
    model_dir = resolve_model(cfg.model, cfg.checkpoint_dir)
    _, model_args = validate_model_dir(model_dir)
    reference = {"model": cfg.model, "model_dir": str(model_dir), "fingerprint": model_fingerprint(model_dir)}
    if cfg.resume:
        check_resume(cfg.resume, model_args, reference)
    if cfg.engine == "vllm":
        require_cuda("--engine vllm", _NATIVE)
    device = resolve_device(cfg.device)
    task = get_task(cfg.task, load_checked_tokenizer(model_dir))
    limit, source = engine_max_model_len(cfg, model_args)
    longest_prompt = check_prompt_lengths(task, cfg, limit, source)
    if device.type == "cuda":
        single_turn = longest_prompt is not None and not getattr(task, "multi_turn", False)
        _check_memory(cfg, model_args, device, longest_prompt + cfg.max_new_tokens if single_turn else limit)
    policy = trainer.build_policy(model_dir, cfg, device)
    start = resume_into(policy, cfg.resume, device) if cfg.resume else 0
    engine = trainer.build_engine(cfg, model_dir, policy)
    if longest_prompt is None:
        engine = LengthCheckedEngine(engine, cfg, limit, source)
    trainer.sync_weights(engine, policy, cfg)  # the engine starts from the trainer's exact weights (matters on resume)
    logger = MetricsLogger(run_dir, {"args": to_dict(cfg), "seed": cfg.seed, "model_dir": str(model_dir),
                                     "device": str(device), "reference": reference},
                           resume_step=start if cfg.resume else None)
    history = []
    try:
        if cfg.eval_every and start == 0:  # the baseline: one eval before the first step
            logger.log_step(0, evaluate(engine, task, cfg), cfg.steps)
        for step in range(start + 1, cfg.steps + 1):
            progress["step"] = step
            scalars = trainer.run_step(step, cfg, task, engine, policy, device, run_dir)
            if cfg.eval_every and step % cfg.eval_every == 0:
                scalars.update(evaluate(engine, task, cfg))
            with signals.deferred():  # a step's log line and its checkpoint are written whole
                logger.log_step(step, scalars, cfg.steps)
                history.append(scalars)
                if step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                    save_checkpoint(cfg, policy, step, model_dir, reference)
                progress["done"] = step
    finally:
        logger.close()
    return history


def _check_memory(cfg: TrainConfig, model_args, device: torch.device, max_seq_len: int) -> None:
    import batch_invariant_backward as bib

    from . import memory_plan

    props = torch.cuda.get_device_properties(device)
    est = memory_plan.check(model_args, cfg, props.total_memory, f"{device} ({props.name})", max_seq_len=max_seq_len,
                            logits_chunk_elements=getattr(bib, "LOGITS_CHUNK_ELEMENTS", None))
    log.info("memory plan: about %.1f of %.1f GiB (%s)", est.total / memory_plan.GIB,
             props.total_memory / memory_plan.GIB, est.summary())
