"""TrainConfig: every knob of simple_rl.py, its default and its help text, in one place.

The CLI is generated from the dataclass: one `--flag` per field, typed from the annotation, with
the help text taken from the docstring written under the field (read with `ast`, so the docstring
is the single source of truth and cannot drift from `--help`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from dataclasses import dataclass, fields

from .spec import EngineSpec, LoRAInit, PolicySpec

DTYPES = ("bfloat16", "float32")
ENGINES = ("vllm", "native")
LOGPROBS_MODES = ("sampling", "raw")


class ConfigError(ValueError):
    """A config value is unusable; the message is one line naming the field and the fix."""


@dataclass
class TrainConfig:
    model: str = "Qwen/Qwen3-1.7B"
    """Checkpoint: a local HF directory, a Hugging Face repo id, or `random:tiny` (a tiny random
    checkpoint written under --checkpoint-dir on the fly; any weights.py shape works)."""
    steps: int = 30
    """GRPO steps (one rollout batch each)."""
    prompts_per_step: int = 8
    """Prompts sampled per step."""
    group_size: int = 8
    """Completions per prompt; advantages are relative to the prompt's group."""
    lr: float = PolicySpec.lr
    """AdamW learning rate (on the fp32 master weights)."""
    weight_decay: float = PolicySpec.weight_decay
    """AdamW weight decay."""
    max_new_tokens: int = 16
    """Longest completion, in tokens."""
    temperature: float = 1.0
    """Sampling temperature."""
    logprobs: str = "sampling"
    """Which distribution's logprobs the engine reports and the trainer trains on: `sampling` =
    the one that sampled (logits / temperature, then min-p), so the PPO ratio and the KL are of the
    policy that generated the tokens; `raw` = the raw logits, whatever the temperature."""
    min_p: float = 0.0
    """Min-p sampling (0 = off): tokens below min_p x the top token's probability are dropped. With
    --logprobs sampling the trainer applies it too, with vLLM's own kernel."""
    top_k: int = -1
    """Top-k sampling (-1 = off). Only with --logprobs raw, and then the trained distribution (raw
    logits) is not the one that sampled (truncated): training is then off-policy. A warning is logged."""
    top_p: float = 1.0
    """Top-p (nucleus) sampling (1.0 = off). Only with --logprobs raw; off-policy like --top-k."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the frozen initial (reference) policy."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    clip_eps: float = 0.2
    """PPO ratio clip: ratios are clipped to [1 - eps, 1 + eps]."""
    seed: int = 0
    """Seed of everything random (prompts, sampling); same seed -> identical run."""
    run_name: str = "grpo"
    """Name of the run: logs go to <out-dir>/<run-name>/, checkpoints to <checkpoint-dir>/<run-name>/."""
    engine: str = "vllm"
    """Rollout engine: `vllm` (GPU, VLLM_BATCH_INVARIANT=1) or `native` (plain PyTorch, CPU ok)."""
    task: str = "arith"
    """Task name (a module in spirl/tasks/): arith, gsm8k, synthetic, or calculator (multi-turn
    tool use: the policy calls a calculator and answers, episodes of up to --max-turns turns)."""
    max_turns: int = 4
    """Multi-turn tasks: most policy turns per episode (--max-new-tokens is per turn)."""
    save_rollouts: int = 0
    """Multi-turn tasks: 1 = write each step's trajectories (ids, loss masks, logprobs, env replies)
    to <out-dir>/<run-name>/rollouts/step_N.jsonl, the input of compare/retokenization.py."""
    detect_retokenization: int = 1
    """Multi-turn tasks: 1 = each step, run compare/retokenization.py's detector on the step's
    trajectories under the current policy and log retok/* (the smoking guns a decode -> re-encode
    pipeline would have trained on; SPIRL itself trains on the sampled ids)."""
    updates_per_batch: int = 1
    """Optimizer steps per rollout batch: the batch is split into this many mini-batches."""
    max_tokens_per_microbatch: int = 16384
    """Gradient accumulation by tokens: each micro-batch packs whole sequences up to this many
    tokens (a longer sequence gets a micro-batch of its own). Bounds activation memory."""
    activation_checkpointing: int = 1
    """1 = keep only each decoder layer's input during the forward and recompute the layer in the
    backward (far less memory, ~1/3 more compute); 0 = keep every activation."""
    gpu_memory_utilization: float = EngineSpec.gpu_memory_utilization
    """Fraction of the GPU's memory the vLLM engine may take (weights + KV cache); the trainer
    gets the rest."""
    eager: int = 0
    """1 = run vLLM eagerly (no CUDA graphs): slower rollouts, same numbers."""
    max_model_len: int = EngineSpec.max_model_len
    """Longest prompt + completion (all turns of an episode) the engine accepts, in tokens."""
    vllm_sleep: int = 0
    """1 = put vLLM to sleep while the trainer trains (its KV cache freed, its weights moved to host
    memory, both restored before the next rollout): more GPU memory for training, ~1 s per step."""
    checkpoint_every: int = 10
    """Write a checkpoint every N steps (and after the last step); 0 = only after the last step."""
    resume: str = ""
    """Checkpoint to resume from: a step directory, or a run's checkpoint directory (its latest)."""
    out_dir: str = "runs"
    """Root of TensorBoard logs, run_metadata.json and metrics.jsonl."""
    checkpoint_dir: str = "checkpoints"
    """Root of training checkpoints (and of `random:` model checkpoints)."""
    device: str = "auto"
    """Trainer device: auto (cuda if available), cpu, cuda."""
    dtype: str = "bfloat16"
    """Compute dtype of the trainer's forward (vLLM runs bf16; use float32 on CPU)."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this value; 0 = no clipping."""
    lora_rank: int = 0
    """LoRA rank r: train low-rank adapters (float32, AdamW) on a frozen bf16 base instead of every
    weight; 0 = full fine-tuning. LoRA wants a learning rate ~10x full fine-tuning's (README)."""
    lora_alpha: float = 0.0
    """LoRA updates are scaled by alpha / rank; 0 = 32 (or the --lora-init adapter's alpha)."""
    lora_targets: str = ""
    """Modules LoRA adapts, comma-separated: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj, lm_head, or the groups attn, mlp, all-linear (= attn + mlp); empty = all-linear (or
    the --lora-init adapter's). lm_head on a model with tied embeddings gets its own output weight;
    the input embedding stays the base's."""
    lora_init: str = ""
    """A PEFT LoRA adapter directory to start from (adapter_config.json + adapter_model.safetensors,
    e.g. a checkpoint of an earlier run); its rank, alpha and targets are used."""
    lora_base: str = PolicySpec.lora_base
    """LoRA: where the frozen base weights live. `host`: pinned CPU memory, so the GPU holds the
    weights once (the engine's merged copy, which the trainer computes with) and each merge after an
    optimizer step streams the base in; `gpu`: a second bf16 copy on the GPU (faster merges, 2 bytes
    per parameter more GPU memory)."""
    eval_every: int = 0
    """Evaluate on the task's held-out set every N steps (and before the first step); 0 = never."""
    eval_pass_k: int = 0
    """With --eval-every: also sample k completions per eval problem and log eval/pass@k; 0 = greedy only."""
    eval_size: int = 0
    """With --eval-every: evaluate on the first N problems of the task's held-out set (the same N at every
    eval; a smaller N makes --eval-every affordable on a CPU); 0 = the whole held-out set."""
    debug: int = 0
    """1 = print the full traceback of every error (also SPIRL_DEBUG=1); by default an expected error is one line."""

    def validate(self) -> "TrainConfig":
        """Raise ConfigError (one line: field and fix) on the first unusable value."""
        checks = [
            (self.steps >= 1, "steps must be >= 1"),
            (self.prompts_per_step >= 1, "prompts_per_step must be >= 1"),
            (self.group_size >= 2, "group_size must be >= 2 for group-relative advantages"),
            (self.lr > 0, "lr must be > 0"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature > 0, "temperature must be > 0 (GRPO needs diverse samples)"),
            (self.kl_coef >= 0, "kl_coef must be >= 0"),
            (self.entropy_coef >= 0, "entropy_coef must be >= 0"),
            (0 < self.clip_eps < 1, "clip_eps must be in (0, 1)"),
            (self.seed >= 0, "seed must be >= 0"),
            (bool(self.run_name) and "/" not in self.run_name, "run_name must be a non-empty name without '/'"),
            (self.engine in ENGINES, f"engine must be one of {', '.join(ENGINES)}"),
            (self.updates_per_batch >= 1, "updates_per_batch must be >= 1"),
            (self.max_tokens_per_microbatch >= 1, "max_tokens_per_microbatch must be >= 1"),
            (self.activation_checkpointing in (0, 1), "activation_checkpointing must be 0 or 1"),
            (0 < self.gpu_memory_utilization < 1, "gpu_memory_utilization must be in (0, 1)"),
            (self.eager in (0, 1), "eager must be 0 or 1"),
            (self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.max_new_tokens < self.max_model_len, "max_new_tokens must be < max_model_len (room for the prompt)"),
            (self.vllm_sleep in (0, 1), "vllm_sleep must be 0 or 1"),
            (self.logprobs in LOGPROBS_MODES, f"logprobs must be one of {', '.join(LOGPROBS_MODES)}"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.logprobs == "raw" or (self.top_k == -1 and self.top_p == 1.0),
             "top_k / top_p need --logprobs raw: the trainer cannot recompute vLLM's truncated "
             "distribution bit for bit (with raw, training on truncated samples is off-policy)"),
            (self.eval_every >= 0, "eval_every must be >= 0"),
            (self.eval_pass_k >= 0, "eval_pass_k must be >= 0"),
            (self.eval_size >= 0, "eval_size must be >= 1, or 0 for the task's whole held-out set"),
            (self.checkpoint_every >= 0, "checkpoint_every must be >= 0"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             "device must be auto, cpu, cuda or cuda:N"),
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}"),
            (self.max_grad_norm >= 0, "max_grad_norm must be >= 0"),
            (self.max_turns >= 1, "max_turns must be >= 1"),
            (self.save_rollouts in (0, 1), "save_rollouts must be 0 or 1"),
            (self.detect_retokenization in (0, 1), "detect_retokenization must be 0 or 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        self._validate_lora()
        n = self.prompts_per_step * self.group_size
        if n % self.updates_per_batch:
            raise ConfigError(f"prompts_per_step * group_size ({n}) must divide into updates_per_batch "
                              f"({self.updates_per_batch}) equal mini-batches")
        if self.engine == "vllm" and self.dtype != "bfloat16":
            raise ConfigError("dtype must be bfloat16 with --engine vllm (vLLM runs bf16); use --engine native for float32")
        return self


    def policy_spec(self, lora: LoRAInit | None = None) -> PolicySpec:
        """The policy this run trains (spirl.core.build.build_policy_and_engine's spec): `lora` is what
        spirl.core.lora.resolve_spec made of the LoRA flags, None for full fine-tuning."""
        engine = EngineSpec(kind=self.engine, logprobs=self.logprobs, seed=self.seed,
                            gpu_memory_utilization=self.gpu_memory_utilization, max_model_len=self.max_model_len,
                            eager=bool(self.eager), sleep_between_rollouts=bool(self.vllm_sleep))
        return PolicySpec(model=self.model, engine=engine, dtype=self.dtype, lora=lora, lr=self.lr,
                          weight_decay=self.weight_decay, reference=self.kl_coef > 0,
                          activation_checkpointing=bool(self.activation_checkpointing), lora_base=self.lora_base,
                          seed=self.seed)

    @property
    def lora(self) -> bool:
        """LoRA training (--lora-rank > 0 or --lora-init) rather than full fine-tuning."""
        return self.lora_rank > 0 or bool(self.lora_init)

    def _validate_lora(self) -> None:
        if self.lora_rank < 0:
            raise ConfigError(f"lora_rank must be >= 1 for LoRA, or 0 for full fine-tuning (got {self.lora_rank})")
        if self.lora_alpha < 0:
            raise ConfigError("lora_alpha must be > 0 (or 0 for the default)")
        if self.lora_base not in ("host", "gpu"):
            raise ConfigError("lora_base must be host or gpu")
        if self.lora_targets:
            from torchtitan_compat.lora import LoRAError, parse_targets

            try:
                parse_targets(self.lora_targets)
            except LoRAError as e:
                raise ConfigError(f"--lora-targets: {e}") from None
        if not self.lora and (self.lora_alpha or self.lora_targets):
            raise ConfigError("--lora-alpha and --lora-targets need --lora-rank > 0 (or --lora-init)")
        if self.lora and self.engine == "vllm" and self.vllm_sleep:
            raise ConfigError("--vllm-sleep 1 cannot be used with LoRA: the trainer computes with the engine's own "
                              "weight tensors, which vLLM's sleep moves off the GPU; LoRA's optimizer state is "
                              "small, so set --vllm-sleep 0")


def field_docs(cls) -> dict[str, str]:
    """{field name: the docstring written right under it} from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line on stderr (no usage dump), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def build_parser(cls=TrainConfig) -> argparse.ArgumentParser:
    parser = OneLineParser(description="GRPO with bitwise parity between rollout engine and trainer.",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    docs = field_docs(cls)
    for f in fields(cls):
        kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=f.default,
                            help=docs.get(f.name, ""))
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and validate; a bad value exits with one line on stderr (status 2)."""
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**vars(args))
    try:
        return cfg.validate()
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


RUN_ONLY_FIELDS = frozenset({"steps", "run_name", "resume", "out_dir", "checkpoint_dir", "checkpoint_every",
                             "eval_every", "eval_pass_k", "eval_size", "save_rollouts", "debug"})
"""Fields that say where a run writes, how its process was started, how long it runs and how often it
reports, not what it trains. A checkpoint leaves them out of the config it records, so that the same
training state is the same bytes whether the run was interrupted and resumed (--resume, another
--steps) or not; the run's run_metadata.json records every field."""


def checkpoint_dict(cfg: TrainConfig) -> dict:
    """The config a checkpoint records: every field but RUN_ONLY_FIELDS."""
    return {k: v for k, v in to_dict(cfg).items() if k not in RUN_ONLY_FIELDS}
