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
import math
import sys
import textwrap
from dataclasses import dataclass, fields

from .spec import EngineSpec, LoRAInit, PolicySpec

DTYPES = ("bfloat16", "float32")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo")
IS_LEVELS = ("token", "sequence")
REWARD_SCALES = ("group", "batch", "none")
ADVANTAGE_STDS = ("population", "sample")
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
    router_aux_loss: int = 0
    """Qwen3-MoE: 1 adds the routers' load-balancing loss times the checkpoint's router_aux_loss_coef, as
    transformers computes it with output_router_logits (TRL's GRPO then adds it to each micro-batch's loss); here
    each micro-batch's share of the mini-batch's tokens weights it. 0 = off."""
    clip_eps: float = 0.2
    """PPO ratio clip: ratios are clipped to [1 - eps, 1 + eps] (TRL's epsilon; the upper bound: --clip-eps-high)."""
    clip_eps_high: float = 0.0
    """Upper clip of the ratio, 1 + clip_eps_high (DAPO's clip-higher: 0.28; TRL's epsilon_high); 0 = the
    same as --clip-eps, as TRL does. With --loss-type cispo it is CISPO's eps_max, the bound of the
    importance weight min(r, eps_max) itself (ScaleRL recommends 5.0), and must be given."""
    loss_type: str = "grpo"
    """How the per-token loss is aggregated (TRL's loss_type): grpo = each sequence's token mean, then the
    mean over sequences; dr_grpo = the token sum / (sequences x --max-new-tokens) (Dr. GRPO); dapo = the token
    mean over the mini-batch (DAPO); bnpo = the same here (TRL's is per device micro-batch); cispo = CISPO's
    clipped-weight loss (MiniMax-M1), aggregated as dapo. Token counts span the whole mini-batch and every
    rank. Default grpo: SPIRL's loss before the menu, so earlier runs keep their numbers (it has a length
    bias; TRL 1.16 defaults to dapo: pass --loss-type dapo for TRL's default)."""
    importance_sampling_level: str = "token"
    """token = a ratio per token; sequence = one ratio per completion, exp(mean over its tokens of
    logp - logp_old) (GSPO; TRL's importance_sampling_level). TRL's default, token."""
    scale_rewards: str = "group"
    """Advantage = reward - group mean, divided by: group = the group's reward std; batch = the whole
    batch's (every rank's); none = nothing (Dr. GRPO). TRL's scale_rewards, and its default (group). Which
    std: --advantage-std."""
    advantage_std: str = "population"
    """The std that --scale-rewards divides by, and that reward_std logs: population = divided by the count,
    + 1e-6 (SPIRL's default, as it always was); sample = Bessel-corrected (divided by the count - 1), + 1e-4,
    TRL's GRPOTrainer (its nanstd), so a TRL run ports exactly. With group size G the advantages differ by about
    sqrt(G / (G - 1)) (1.155x at G = 4) unless the std is tiny."""
    mask_truncated_completions: int = 0
    """1 = completions cut at --max-new-tokens (no EOS) get no loss (they still count as sequences in
    grpo's and dr_grpo's means, not in dapo's token count), as TRL's mask_truncated_completions and DAPO's
    overlong filtering; 0 = off (TRL's default)."""
    dynamic_sampling: int = 0
    """1 = DAPO's dynamic sampling: groups whose rewards are all equal (no learning signal) are dropped and
    more prompts are sampled, until --prompts-per-step groups are kept or --dynamic-sampling-max-rounds
    rounds of --prompts-per-step prompts were sampled (then the step trains on what is kept, with a
    warning). Logged as dynamic/*; parity is checked on every sampled token, kept or not."""
    dynamic_sampling_max_rounds: int = 10
    """--dynamic-sampling and --filter: most rounds of sampling per step (10: the DAPO recipe's
    max_num_gen_batches in verl)."""
    filter: tuple[str, ...] = ()
    """Sample filters (repeatable): a step trains on the first --prompts-per-step groups (one prompt's samples)
    that every filter keeps; dropped groups are replaced by new prompts in further rounds, as --dynamic-sampling
    does (it is `--filter reward_spread`). Built-ins: reward_spread, min_reward:X (best reward >= X), diversity:F
    (distinct completions / group size >= F), length:LO-HI (every completion's tokens); or path/to/file.py:func
    / package.module:func, called per group as func(prompts, completions, completion_ids, rewards, **kwargs) ->
    bool (spirl/loops/filters.py). Logged as filter/<name>/dropped and dynamic/*."""
    oversample: float = 1.0
    """With --filter or --dynamic-sampling: each round samples ceil(--prompts-per-step x oversample) prompts, and
    the step trains on the first --prompts-per-step groups kept, in the order sampled (1 = no over-sampling)."""
    seed: int = 0
    """Seed of everything random (prompts, sampling); same seed -> identical run."""
    run_name: str = "grpo"
    """Name of the run: logs go to <out-dir>/<run-name>/, checkpoints to <checkpoint-dir>/<run-name>/."""
    engine: str = "vllm"
    """Rollout engine: `vllm` (GPU, VLLM_BATCH_INVARIANT=1) or `native` (plain PyTorch, CPU ok)."""
    task: str = "arith"
    """Task: arith, gsm8k, synthetic, calculator (multi-turn tool use: the policy calls a calculator and
    answers, episodes of up to --max-turns turns); reasoning_gym:NAME[,NAME...] (reasoning-gym's procedural
    tasks, generated offline: its questions, its answer format, its own score_answer; --task-size,
    --task-seed); path/to/task.py (its make(tokenizer)), path/to/task.py:func or package.module:func (a
    task from outside the package, same protocol as spirl/tasks/). Not with --dataset."""
    task_size: int = 500
    """reasoning_gym tasks: problems in the training set (reasoning-gym's own default size)."""
    task_seed: int = 0
    """reasoning_gym tasks: the generator's seed; the problems do not depend on --seed (reasoning-gym itself
    would pick a random seed, so one is always set)."""
    dataset: str = ""
    """Your own prompts instead of --task: a JSONL, JSON, parquet or CSV file, a directory, or an id that
    datasets.load_dataset takes (a local path needs no network). Its `prompt` column is TRL's: a string
    (tokenized as text) or a list of chat messages (through the chat template); every other column goes
    to the --reward functions. Read in epochs of seeded shuffles (--seed); the position is in every
    checkpoint, so --resume continues the same order."""
    dataset_split: str = "train"
    """--dataset / --eval-dataset: the split to read (a single file is read as this split)."""
    eval_dataset: str = ""
    """--dataset runs: held-out prompts (same format) for --eval-every, scored by the same --reward
    functions (eval/accuracy: the share whose greedy completion's reward is >= 1; eval/reward/<func>)."""
    reward: tuple[str, ...] = ()
    """--dataset runs: a reward function with TRL's signature f(prompts, completions, completion_ids,
    **columns) -> list[float | None] (None = does not apply to that sample): path/to/file.py:func,
    package.module:func, or `math` (math-verify against an `answer` or `solution` column). Repeatable;
    each function's mean is logged as reward/<func>."""
    reward_weights: str = ""
    """--dataset runs: comma-separated weights of the --reward functions, in order; a sample's reward is the
    weighted sum of the functions that applied to it; empty = 1.0 each (TRL's default)."""
    chat_template_kwargs: str = ""
    """--dataset chat prompts and reasoning_gym tasks: a JSON object passed to the chat template (TRL's
    chat_template_kwargs), e.g. '{"enable_thinking": false}'; empty = the template's own defaults."""
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
    off_policy_steps: int = 0
    """Asynchronous GRPO: the engine samples step s + K while the trainer trains step s, so a step trains on
    samples of the weights K updates old (steps 1..K + 1: the initial weights); each rollout's logprobs are still
    checked bit for bit, when it is sampled, against the trainer under the weights that sampled it. The schedule
    depends on K and --seed only: a run repeats and resumes bit for bit. 0 = synchronous (sample, then train).
    spirl/loops/ahead.py."""
    generation_gpus: int = 0
    """M > 0: the rollout engines on GPUs of their own, one per trainer rank of the node, each in a process of its
    own, on GPU local_rank + M (one process: M = 1, the GPU after the trainer's; on a machine without CUDA, a
    second process on the CPU): with --off-policy-steps K the sampling overlaps the trainer's step on other
    devices, and the weights are sent to the engines after each update; the run is the colocated run bit for bit.
    M must equal the node's trainer ranks (--nproc-per-node; 1 without torchrun). --gpu-memory-utilization is then
    an engine's share of its own GPU. 0 = each engine in its trainer's process. Full fine-tuning, single-turn
    tasks. spirl/core/rollout_engine.py."""
    partial_rollout_tokens: int = 0
    """Partial rollouts: a step samples at most this many new tokens per completion; completions that have not
    ended are carried to the next step and continued there (under that step's weights), and a group is trained
    on in the step its last completion ends, with each token's behaviour logprob from the weights that sampled
    it (checked bit for bit then). Decided by the seeds and the schedule, never by timing; checkpoints hold what
    is carried. 0 = off (every completion ends within its step). spirl/loops/partial.py."""
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
    precompile: int = 0
    """1 = on a GPU, before step 1, build every Triton kernel the run can need (the engine's prefills and the
    trainer's forward and backward at each token count where a kernel's key changes; spirl/loops/precompile.py),
    so that no step compiles and step 1 takes as long as the others; the same numbers either way. Off by default:
    it costs more start-up time than it saves (H100: 9-17 s with a filled kernel cache, where step 1 compiles
    nothing anyway; 26-33 s with an empty one, against 6-10 s of compiles in step 1; docs/cold-start.md)."""
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
        for ok, msg in [*self._run_rules(), *self._sampling_rules(), *self._loss_rules(), *self._data_rules()]:
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

    def _run_rules(self) -> list[tuple[bool, str]]:
        """(holds, the one line when it does not) of the run's length, engine, memory and output settings."""
        return [
            (self.steps >= 1, "steps must be >= 1"),
            (self.prompts_per_step >= 1, "prompts_per_step must be >= 1"),
            (self.group_size >= 2, "group_size must be >= 2 for group-relative advantages"),
            (self.lr > 0, "lr must be > 0"),
            (self.weight_decay >= 0, "weight_decay must be >= 0"),
            (self.seed >= 0, "seed must be >= 0"),
            (bool(self.run_name) and "/" not in self.run_name, "run_name must be a non-empty name without '/'"),
            (self.engine in ENGINES, f"engine must be one of {', '.join(ENGINES)}"),
            (self.updates_per_batch >= 1, "updates_per_batch must be >= 1"),
            (self.max_tokens_per_microbatch >= 1, "max_tokens_per_microbatch must be >= 1"),
            (self.activation_checkpointing in (0, 1), "activation_checkpointing must be 0 or 1"),
            (0 < self.gpu_memory_utilization < 1, "gpu_memory_utilization must be in (0, 1)"),
            (self.eager in (0, 1), "eager must be 0 or 1"),
            (self.precompile in (0, 1), "precompile must be 0 or 1"),
            (self.vllm_sleep in (0, 1), "vllm_sleep must be 0 or 1"),
            (self.off_policy_steps >= 0, "off_policy_steps must be >= 0 (0 = synchronous)"),
            (self.partial_rollout_tokens >= 0, "partial_rollout_tokens must be >= 0 (0 = off)"),
            (self.generation_gpus >= 0, "generation_gpus must be >= 0 (0: each engine in its trainer's process)"),
            (not (self.generation_gpus and self.lora),
             "--generation-gpus with LoRA: LoRA's trainer computes with the engine's own weight tensors, which "
             "another process cannot share; train LoRA with --generation-gpus 0"),
            (not (self.generation_gpus and self.vllm_sleep),
             "--generation-gpus with --vllm-sleep 1: the engine has a GPU of its own, nothing to free; set "
             "--vllm-sleep 0"),
            (not (self.partial_rollout_tokens and (self.filter or self.dynamic_sampling)),
             "--partial-rollout-tokens with --filter / --dynamic-sampling: a filter would judge groups before their "
             "completions end; use one of them"),
            (not (self.off_policy_steps and self.vllm_sleep),
             "--vllm-sleep 1 cannot be used with --off-policy-steps: the engine samples the next rollout while the "
             "trainer trains, so it cannot sleep then; set --vllm-sleep 0 (or --off-policy-steps 0)"),
            (self.eval_every >= 0, "eval_every must be >= 0"),
            (self.eval_pass_k >= 0, "eval_pass_k must be >= 0"),
            (self.eval_size >= 0, "eval_size must be >= 1, or 0 for the task's whole held-out set"),
            (self.checkpoint_every >= 0, "checkpoint_every must be >= 0"),
            (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             "device must be auto, cpu, cuda or cuda:N"),
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}"),
            (self.max_grad_norm >= 0, "max_grad_norm must be >= 0"),
            (self.save_rollouts in (0, 1), "save_rollouts must be 0 or 1"),
            (self.detect_retokenization in (0, 1), "detect_retokenization must be 0 or 1"),
        ]

    def _sampling_rules(self) -> list[tuple[bool, str]]:
        """... of what the engine samples and which logprobs it reports."""
        return [
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (self.temperature > 0, "temperature must be > 0 (GRPO needs diverse samples)"),
            (self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.max_new_tokens < self.max_model_len, "max_new_tokens must be < max_model_len (room for the prompt)"),
            (self.logprobs in LOGPROBS_MODES, f"logprobs must be one of {', '.join(LOGPROBS_MODES)}"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.logprobs == "raw" or (self.top_k == -1 and self.top_p == 1.0),
             "top_k / top_p need --logprobs raw: the trainer cannot recompute vLLM's truncated "
             "distribution bit for bit (with raw, training on truncated samples is off-policy)"),
            (self.max_turns >= 1, "max_turns must be >= 1"),
        ]

    def _loss_rules(self) -> list[tuple[bool, str]]:
        """... of the loss menu."""
        return [
            (self.kl_coef >= 0, "kl_coef must be >= 0"),
            (self.entropy_coef >= 0, "entropy_coef must be >= 0"),
            (self.router_aux_loss in (0, 1), "router_aux_loss must be 0 or 1"),
            (0 < self.clip_eps < 1, "clip_eps must be in (0, 1)"),
            (self.loss_type in LOSS_TYPES, f"loss_type must be one of {', '.join(LOSS_TYPES)}"),
            (self.importance_sampling_level in IS_LEVELS,
             f"importance_sampling_level must be one of {', '.join(IS_LEVELS)}"),
            (self.scale_rewards in REWARD_SCALES, f"scale_rewards must be one of {', '.join(REWARD_SCALES)}"),
            (self.advantage_std in ADVANTAGE_STDS, f"advantage_std must be one of {', '.join(ADVANTAGE_STDS)}"),
            (self.clip_eps_high >= 0, "clip_eps_high must be >= 0 (0 = the same as --clip-eps)"),
            (self.loss_type != "cispo" or self.clip_eps_high > 0,
             "--loss-type cispo needs --clip-eps-high: CISPO's eps_max, the bound of the importance weight "
             "min(r, eps_max) (ScaleRL recommends 5.0; TRL would use --clip-eps, 0.2, which clips nearly every token)"),
            (self.mask_truncated_completions in (0, 1), "mask_truncated_completions must be 0 or 1"),
            (self.dynamic_sampling in (0, 1), "dynamic_sampling must be 0 or 1"),
            (self.dynamic_sampling_max_rounds >= 1, "dynamic_sampling_max_rounds must be >= 1"),
            (self.oversample >= 1.0 and self.oversample == self.oversample, "oversample must be >= 1"),
            (self.oversample == 1.0 or bool(self.filter) or bool(self.dynamic_sampling),
             "--oversample needs --filter or --dynamic-sampling 1: without a filter every group is kept, and the "
             "extra prompts would be sampled for nothing"),
        ]

    def _data_rules(self) -> list[tuple[bool, str]]:
        """... of the prompts and their rewards."""
        return [
            (self.task_size >= 1, "task_size must be >= 1"),
            (self.task_seed >= 0, "task_seed must be >= 0"),
            (not self.dataset or self.task == TrainConfig.task,
             f"--dataset and --task {self.task} both name the prompts: pass one of them"),
            (bool(self.dataset) or not (self.reward or self.reward_weights or self.eval_dataset),
             "--reward, --reward-weights and --eval-dataset go with --dataset (a --task brings its own reward)"),
            (not self.dataset or bool(self.reward),
             "--dataset needs at least one --reward (path/to/file.py:func, package.module:func or math)"),
        ]

    def policy_spec(self, lora: LoRAInit | None = None) -> PolicySpec:
        """The policy this run trains (spirl.core.build.build_policy_and_engine's spec): `lora` is what
        spirl.core.lora.resolve_spec made of the LoRA flags, None for full fine-tuning."""
        engine = EngineSpec(kind=self.engine, logprobs=self.logprobs, seed=self.seed,
                            gpu_memory_utilization=self.gpu_memory_utilization, max_model_len=self.max_model_len,
                            eager=bool(self.eager), sleep_between_rollouts=bool(self.vllm_sleep),
                            separate_gpus=self.generation_gpus)
        return PolicySpec(model=self.model, engine=engine, dtype=self.dtype, lora=lora, lr=self.lr,
                          weight_decay=self.weight_decay, reference=self.kl_coef > 0,
                          activation_checkpointing=bool(self.activation_checkpointing), lora_base=self.lora_base,
                          seed=self.seed)

    @property
    def prompts_per_round(self) -> int:
        """How many prompts a round of sampling draws: --prompts-per-step, times --oversample rounded up."""
        return math.ceil(self.prompts_per_step * self.oversample - 1e-9)

    @property
    def checks_after_update(self) -> bool:
        """With --off-policy-steps and engines on GPUs of their own (one round of sampling a step): a rollout is
        checked and scored after the trainer's optimizer step, on a copy of the weights that sampled it kept from
        before that step, so the engine samples the next rollout meanwhile (spirl.loops.trainer.run_step). The
        same numbers as checking it before the update; it costs the kept copy's memory."""
        return bool(self.off_policy_steps and self.generation_gpus and not (self.filter or self.dynamic_sampling))

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
        flag, help = "--" + f.name.replace("_", "-"), docs.get(f.name, "")
        if _repeatable(f):  # tuple[str, ...]: the flag may be given several times
            parser.add_argument(flag, dest=f.name, type=str, action="append", default=None,
                                help=help)
            continue
        kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
        parser.add_argument(flag, dest=f.name, type=kind, default=f.default, help=help)
    return parser


def _repeatable(f) -> bool:
    return str(f.type).replace(" ", "").startswith("tuple[str,...]")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and validate; a bad value exits with one line on stderr (status 2)."""
    args = vars(build_parser().parse_args(argv))
    for f in fields(TrainConfig):
        if _repeatable(f):
            args[f.name] = tuple(args[f.name] or ())
    cfg = TrainConfig(**args)
    try:
        return cfg.validate()
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None


def to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)


RUN_ONLY_FIELDS = frozenset({"steps", "run_name", "resume", "out_dir", "checkpoint_dir", "checkpoint_every",
                             "eval_every", "eval_pass_k", "eval_size", "eval_dataset", "save_rollouts", "debug",
                             "precompile"})
"""Fields that say where a run writes, how its process was started, how long it runs and how often it
reports, not what it trains. A checkpoint leaves them out of the config it records, so that the same
training state is the same bytes whether the run was interrupted and resumed (--resume, another
--steps) or not; the run's run_metadata.json records every field."""


def checkpoint_dict(cfg: TrainConfig) -> dict:
    """The config a checkpoint records: every field but RUN_ONLY_FIELDS."""
    return {k: v for k, v in to_dict(cfg).items() if k not in RUN_ONLY_FIELDS}
