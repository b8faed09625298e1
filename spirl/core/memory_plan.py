"""Will the run fit on the GPU? A conservative estimate of the trainer's peak, checked before anything is loaded.

`estimate(model_args, cfg, gpu_total_bytes)` needs no GPU (the caller passes the device's total
bytes), so it is tested on the CPU. `check(...)` raises a one-line UserError (exit status 5)
naming the flag to change when the estimate exceeds the GPU. simple_rl.py calls it when the
trainer runs on CUDA, with torch.cuda.get_device_properties(device).total_memory.

What is counted (P = parameters, c = bytes per element of the compute dtype: 2 for bf16):
    fp32 master weights                 4 P
    compute-dtype model                 c P
    reference policy                    c P    only when kl_coef > 0
    AdamW state (exp_avg, exp_avg_sq)   8 P
    fp32 gradients of the masters       4 P
    compute-dtype gradients             c P    transient, per micro-batch
    activations of one micro-batch of T tokens (T: below), c bytes per element:
        with activation checkpointing: each decoder layer's input [T, dim] x n_layers, plus one
        layer's activations and their gradients (2 x A);
        without: every layer's activations (n_layers x A) plus one layer's gradients (A);
        A = T x (2 q + 3 kv + M + 6 dim) elements per layer (q = n_heads x head_dim,
        kv = n_kv_heads x head_dim: the qkv projection, normed/rotated q and k, the attention
        output, norms, residuals, projections; M = the MLP's, `mlp_activation_width`: 4 hidden_dim
        dense, far more for Qwen3-MoE's routed slots)
    lm_head logits of the micro-batch's rows in fp32: T x vocab x 4 B, x 2 for the backward
        (x 3 of one chunk instead when lm_head runs in chunks of `logits_chunk_elements`)
    vLLM's share                        gpu_memory_utilization x GPU total (engine vllm; not
                                        during training with --vllm-sleep 1; none with
                                        --generation-gpus: the engine's own GPU)
    fixed overhead                      1 GiB (CUDA context, GEMM workspaces, allocator slack)
LoRA (`lora`, a LoRASpec; n = adapter parameters): no fp32 masters, model copy or gradients of
the base: adapters 4 n + their grads 4 n + AdamW 8 n (+ 8 n of initial adapters with a KL term);
the trainer computes with the engine's weights (inside vLLM's share; the native engine: its own
c P); the frozen base of the adapted projections on the GPU only with --lora-base gpu (c x their
parameters; host memory otherwise); a merge's temporaries (two float32 copies of the largest
adapted block and its base). LoRA on a Qwen3-MoE's experts: the base counts every expert of the
adapted parameters, the largest block is one layer's stacked [E, out, in] parameter, and one sparse
layer's backward holds its experts' weight gradients (c x both parameters) and a float32 copy of the
larger one (torchtitan_compat/lora_experts.py maps them to the adapters). vLLM's share must hold the weights plus the KV cache of one sequence of
max_model_len tokens (`min_kv_bytes`); a GPU on which no share leaves the trainer enough is refused
in one line (tensor-parallel engines are not supported yet: every GPU holds the whole bf16 model).
Sharded over W ranks (torchrun, FSDP2; per GPU): masters, AdamW state, fp32 gradients and the
reference are divided by W; the compute-dtype weights (and their gradients) that exist whole are
those of the embedding/head plus two decoder layers (the one computing and the one prefetched),
plus one layer's fp32 gradients for the reduce-scatter.
T = the tokens one micro-batch can hold: min(max(max_tokens_per_microbatch, L), S x L), where L
is the longest sequence (prompt + completion; max_model_len when the prompts are not known) and
S the sequences of one mini-batch (prompts_per_step x group_size / updates_per_batch).
It is an upper bound on purpose: a run it accepts should not run out of memory; one it refuses
names the one change that makes the estimate fit, or else the changes, with their values, that fit together.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

GIB = 2**30
OVERHEAD_BYTES = 1 * GIB
SLEEPING_VLLM_BYTES = GIB // 2
"""What a sleeping vLLM engine keeps on the GPU (CUDA graphs pool, its context): a guess."""
MIN_VLLM_KV_BYTES = GIB // 2
"""The least KV cache worth starting vLLM with, on top of its bf16 weights."""
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class MemoryEstimate:
    parts: dict[str, int] = field(default_factory=dict)
    """Bytes per item of the peak, in the order of the module docstring."""
    gpu_total: int = 0
    tokens_per_microbatch: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_total

    def summary(self) -> str:
        """'masters 4.0 + ... GiB' in one line."""
        return " + ".join(f"{k} {v / GIB:.1f}" for k, v in self.parts.items() if v) + " GiB"


def layer_param_count(args, i: int | None = None) -> int:
    """Parameters of decoder layer i (None: the largest layer). A Qwen3-MoE sparse layer has a router (E x dim)
    and E experts of 3 x dim x moe_inter_dim in place of the dense MLP."""
    from torchtitan_compat.config import sparse_layers

    d, dh, inter = args.dim, args.head_dim, args.hidden_dim
    q, kv = args.n_heads * dh, args.n_kv_heads * dh
    sparse = sparse_layers(args)
    dense_mlp = 3 * d * inter
    moe_mlp = args.moe_args.num_experts * (d + 3 * d * args.moe_inter_dim) if sparse else 0
    if i is not None:
        mlp = moe_mlp if i in sparse else dense_mlp
    else:
        mlp = max(moe_mlp, dense_mlp if len(sparse) < args.n_layers else 0)
    return d * (q + 2 * kv) + q * d + 2 * dh + 2 * d + mlp


def decoder_param_count(args) -> int:
    """Parameters of all decoder layers."""
    return sum(layer_param_count(args, i) for i in range(args.n_layers))


def param_count(args) -> int:
    """Parameters of a Qwen3 model from torchtitan's Qwen3ModelArgs."""
    head = 0 if args.enable_weight_tying else args.vocab_size * args.dim
    return args.vocab_size * args.dim + decoder_param_count(args) + args.dim + head


def mlp_activation_width(args) -> int:
    """Elements per token of a layer's MLP activations and backward temporaries (the largest layer): dense 4 x
    hidden_dim (gate/up, SiLU-and-mul); Qwen3-MoE E router logits and, per routed slot, the gate/up output, the
    SwiGLU output, the down output and the backward's gathered rows and float32 temporaries (k x (8 I + 8 dim))."""
    from torchtitan_compat.config import sparse_layers

    dense = 4 * args.hidden_dim
    sparse = sparse_layers(args)
    if not sparse:
        return dense
    moe = args.moe_args.num_experts + args.moe_args.top_k * 8 * (args.moe_inter_dim + args.dim)
    return max(moe, dense if len(sparse) < args.n_layers else 0)


def tokens_per_microbatch(cfg, max_seq_len: int) -> int:
    seqs = max(1, cfg.prompts_per_step * cfg.group_size // max(1, cfg.updates_per_batch))
    return min(max(cfg.max_tokens_per_microbatch, max_seq_len), seqs * max_seq_len)


def _lora_parts(args, cfg, lora, c: int) -> dict[str, int]:
    """The LoRA run's weights and optimizer items (module docstring)."""
    from torchtitan_compat.config import sparse_layers
    from torchtitan_compat.lora import (expert_shapes, expert_targets, fused_modules, linear_targets, lora_param_count,
                                        target_shapes)

    n = lora_param_count(lora, args)
    shapes = target_shapes(args)
    experts = expert_targets(lora, args)
    sizes = {t: args.moe_args.num_experts * o * i for t, (o, i) in expert_shapes(args).items()} if experts else {}
    adapted = sum(sizes[t] for t in experts) * len(sparse_layers(args))
    biggest = max([0] + [sizes[t] for t in experts])
    modules = linear_targets(lora, args) + (("lm_head",) if "lm_head" in lora.targets else ())
    for path, blocks in fused_modules(args).items():
        if any(t in modules for t, _, _ in blocks):  # the base keeps the whole fused matrix
            in_features = shapes[blocks[0][0]][1]
            adapted += sum(rows for _, _, rows in blocks) * in_features * (1 if path == "output" else args.n_layers)
            biggest = max([biggest] + [rows * in_features for t, _, rows in blocks if t in lora.targets])
    untied_head = args.vocab_size * args.dim if "lm_head" in lora.targets and args.enable_weight_tying else 0
    return {
        "LoRA adapters": 4 * n + (4 * n if cfg.kl_coef > 0 else 0),
        "compute model": 0 if cfg.engine == "vllm" else c * (param_count(args) + untied_head),
        "AdamW state": 8 * n,
        "fp32 grads": 4 * n,
        "frozen base": c * adapted if cfg.lora_base == "gpu" else 0,
        "LoRA merge": (2 * 4 + c) * biggest,
        "LoRA expert grads": c * sum(sizes.values()) + 4 * biggest if experts else 0,
    }


def vllm_weight_bytes(args, lora=None) -> int:
    """The bf16 weights vLLM holds (an untied lm_head of its own for LoRA on a tied head)."""
    untied_head = args.vocab_size * args.dim if lora is not None and "lm_head" in lora.targets and \
        args.enable_weight_tying else 0
    return 2 * (param_count(args) + untied_head)


def estimate(args, cfg, gpu_total_bytes: int, max_seq_len: int | None = None,
             logits_chunk_elements: int | None = None, shards: int = 0, lora=None) -> MemoryEstimate:
    """The trainer's peak GPU memory for model `args` under TrainConfig `cfg` (see the module
    docstring). `max_seq_len`: the longest prompt + completion if known (else cfg.max_model_len
    or 4096). `logits_chunk_elements`: lm_head's chunk size in logit elements when it is chunked.
    `shards`: the ranks FSDP2 shards over (0: not sharded). `lora`: the run's LoRASpec, if any."""
    c = _DTYPE_BYTES.get(cfg.dtype, 4)
    p = param_count(args)
    per_rank = p / shards if shards else p
    whole = p if not shards else p - decoder_param_count(args) + 2 * layer_param_count(args)
    length = max_seq_len or getattr(cfg, "max_model_len", 4096)
    t = tokens_per_microbatch(cfg, length)
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    layer = t * (2 * q + 3 * kv + mlp_activation_width(args) + 6 * args.dim) * c
    if cfg.activation_checkpointing:
        activations = args.n_layers * t * args.dim * c + 2 * layer
    else:
        activations = args.n_layers * layer + layer
    activations += 2 * t * args.dim * 4  # final hidden states and their gradient
    rows = t * args.vocab_size
    logits = 3 * min(rows, logits_chunk_elements) * 4 if logits_chunk_elements else 2 * rows * 4
    vllm = 0
    if cfg.engine == "vllm" and not getattr(cfg, "generation_gpus", 0):  # else the engine has a GPU of its own
        share = int(cfg.gpu_memory_utilization * gpu_total_bytes)
        vllm = SLEEPING_VLLM_BYTES if getattr(cfg, "vllm_sleep", 0) else share
    parts = {
        "fp32 masters": int(4 * per_rank),
        "compute model": c * whole,
        "reference": int(c * per_rank) if cfg.kl_coef > 0 else 0,
        "AdamW state": int(8 * per_rank),
        "fp32 grads": int(4 * per_rank),
        "compute grads": c * whole + (4 * layer_param_count(args) if shards else 0),
        "activations": activations,
        "logits": logits,
        "vLLM": vllm,
        "overhead": OVERHEAD_BYTES,
    }
    if getattr(cfg, "checks_after_update", False):  # the weights a rollout is checked on after the update
        parts["weights kept for the check"] = int((4 if shards else c) * per_rank)
    if lora is not None:
        parts.update(_lora_parts(args, cfg, lora, c), **{"fp32 masters": 0, "reference": 0, "compute grads": 0})
    est = MemoryEstimate(parts, int(gpu_total_bytes), t)
    if cfg.engine == "vllm" and getattr(cfg, "vllm_sleep", 0):
        # the rollout phase: vLLM awake with its whole share, no gradients or activations
        rollout = sum(parts[k] for k in ("fp32 masters", "compute model", "reference", "AdamW state", "overhead"))
        rollout += int(cfg.gpu_memory_utilization * gpu_total_bytes)
        if rollout > est.total:
            est.parts["vLLM"] += rollout - est.total
    return est


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _suggestions(args, cfg, gpu_total: int, **kw) -> list[str]:
    """Single flag changes (in order of least effect on the run) that make the estimate fit."""
    fits = lambda **change: estimate(args, replace(cfg, **change), gpu_total, **kw).fits  # noqa: E731
    lora = kw.get("lora") is not None
    out = []
    if lora and cfg.lora_base == "gpu" and fits(lora_base="host"):
        out.append("set --lora-base host")
    if not cfg.activation_checkpointing and fits(activation_checkpointing=1):
        out.append("set --activation-checkpointing 1")
    budget = cfg.max_tokens_per_microbatch // 2
    while budget >= 256:
        if fits(max_tokens_per_microbatch=budget):
            out.append(f"lower --max-tokens-per-microbatch to {budget} (now {cfg.max_tokens_per_microbatch})")
            break
        budget //= 2
    if cfg.engine == "vllm":
        if _can_sleep(cfg, lora) and fits(vllm_sleep=1):
            out.append("set --vllm-sleep 1")
        floor = (vllm_weight_bytes(args, kw.get("lora")) + min_kv_bytes(args, cfg) + OVERHEAD_BYTES) / gpu_total
        util = round(cfg.gpu_memory_utilization - 0.05, 2)
        while util >= max(floor, 0.05):
            if fits(gpu_memory_utilization=util):
                out.append(f"lower --gpu-memory-utilization to {util:.2f} (now {cfg.gpu_memory_utilization})")
                break
            util = round(util - 0.05, 2)
    if cfg.kl_coef > 0 and not lora and fits(kl_coef=0.0):
        out.append("set --kl-coef 0 (no reference copy)")
    return out


def _can_sleep(cfg, lora: bool) -> bool:
    """--vllm-sleep 1 is a fix to offer: not set, not LoRA (which computes with the engine's tensors), and the
    engine is idle while the trainer trains (not with --off-policy-steps)."""
    return hasattr(cfg, "vllm_sleep") and not cfg.vllm_sleep and not lora and not getattr(cfg, "off_policy_steps", 0)


def _together(args, cfg, gpu_total: int, **kw) -> list[str]:
    """Flag changes that make the estimate fit together, each at the value it needs (empty if none do): the
    fewest switches (of --lora-base host, --activation-checkpointing 1, --vllm-sleep 1, --kl-coef 0; dropping
    the KL term, which changes the objective, only if nothing else fits; among as many, those of least effect
    on the run), with the largest --max-tokens-per-microbatch and, with it, the largest engine share that fit
    (never below what the engine's weights and one sequence's KV cache need)."""
    lora = kw.get("lora") is not None
    fits = lambda change: estimate(args, replace(cfg, **change), gpu_total, **kw).fits  # noqa: E731
    switches = {}
    if lora and cfg.lora_base == "gpu":
        switches["lora_base"] = "host"
    if not cfg.activation_checkpointing:
        switches["activation_checkpointing"] = 1
    vllm = cfg.engine == "vllm"
    if vllm and _can_sleep(cfg, lora):
        switches["vllm_sleep"] = 1
    if cfg.kl_coef > 0 and not lora:
        switches["kl_coef"] = 0.0
    floor = (vllm_weight_bytes(args, kw.get("lora")) + min_kv_bytes(args, cfg) + OVERHEAD_BYTES) / gpu_total
    utils = [cfg.gpu_memory_utilization]
    while vllm and round(utils[-1] - 0.05, 2) >= max(floor, 0.05):
        utils.append(round(utils[-1] - 0.05, 2))
    budgets = [cfg.max_tokens_per_microbatch]
    while budgets[-1] // 2 >= 256:
        budgets.append(budgets[-1] // 2)
    names = list(switches)
    subsets = sorted((c for n in range(len(names) + 1) for c in itertools.combinations(names, n)),
                     key=lambda c: ("kl_coef" in c, len(c), [names.index(x) for x in c][::-1]))
    candidates = ({**{k: switches[k] for k in subset}, "max_tokens_per_microbatch": b, "gpu_memory_utilization": u}
                  for subset in subsets for b in budgets for u in utils)
    change = next((c for c in candidates if fits(c)), None)
    if change is None:
        return []
    words = {"lora_base": "set --lora-base host", "activation_checkpointing": "set --activation-checkpointing 1",
             "vllm_sleep": "set --vllm-sleep 1", "kl_coef": "set --kl-coef 0 (no reference copy)"}
    out = [words[k] for k in switches if k in change]
    if change["max_tokens_per_microbatch"] != cfg.max_tokens_per_microbatch:
        out.append(f"lower --max-tokens-per-microbatch to {change['max_tokens_per_microbatch']} "
                   f"(now {cfg.max_tokens_per_microbatch})")
    if change["gpu_memory_utilization"] != cfg.gpu_memory_utilization:
        out.append(f"lower --gpu-memory-utilization to {change['gpu_memory_utilization']:.2f} "
                   f"(now {cfg.gpu_memory_utilization})")
    return out


def kv_bytes_per_token(args) -> int:
    """vLLM's bf16 KV cache per token: keys and values of every layer."""
    return 2 * 2 * args.n_layers * args.n_kv_heads * args.head_dim


def min_kv_bytes(args, cfg) -> int:
    """The least KV cache vLLM starts with: one sequence of max_model_len tokens (vLLM refuses less), and
    at least MIN_VLLM_KV_BYTES."""
    return max(MIN_VLLM_KV_BYTES, kv_bytes_per_token(args) * getattr(cfg, "max_model_len", 4096))


def _refuse_if_no_share_fits(args, cfg, gpu_total: int, gpu_name: str, weights: int, kv: int, least: float,
                             **kw) -> None:
    """One line when no engine share works on this GPU: the engine (one whole bf16 copy of the weights per
    GPU: tensor-parallel engines are not supported yet) plus the least the trainer needs beside it, with
    every memory flag at its cheapest, exceed the GPU."""
    from .errors import EXIT_MEMORY, UserError

    cheapest = dict(activation_checkpointing=1, max_tokens_per_microbatch=256, gpu_memory_utilization=least)
    lora = kw.get("lora") is not None
    if lora:
        cheapest["lora_base"] = "host"
    elif hasattr(cfg, "vllm_sleep"):
        cheapest.update(vllm_sleep=1, kl_coef=0.0)
    best = estimate(args, replace(cfg, **cheapest), gpu_total, **kw)
    if (least < 1 and best.fits) or best.total - best.parts["vLLM"] > gpu_total:
        return  # fits, or the trainer alone does not: `check` says so
    need = max(best.total, weights + kv + OVERHEAD_BYTES)
    shards = kw.get("shards") or 0
    more = "" if lora or shards else ", more GPUs (torchrun shards the trainer's state)"
    raise UserError(f"the rollout engine's bf16 weights alone are {weights / GIB:.1f} GiB on every GPU, and with them "
                    f"the run needs at least {need / GIB:.1f} GiB per GPU ({best.summary()}) but {gpu_name} has "
                    f"{gpu_total / GIB:.1f} GiB: use GPUs with at least {math.ceil(need / GIB)} GiB{more}, or a "
                    "smaller model (tensor-parallel engines, which split the weights over GPUs, are not supported "
                    "yet)", EXIT_MEMORY)


def check(args, cfg, gpu_total_bytes: int, gpu_name: str = "the GPU", **kw) -> MemoryEstimate:
    """The estimate, or a one-line UserError (exit 5) naming the flag to change if it does not fit."""
    from .errors import EXIT_MEMORY, UserError

    est = estimate(args, cfg, gpu_total_bytes, **kw)
    if cfg.engine == "vllm":
        share, need = cfg.gpu_memory_utilization * gpu_total_bytes, vllm_weight_bytes(args, kw.get("lora"))
        kv = min_kv_bytes(args, cfg)
        least = math.ceil((need + kv + OVERHEAD_BYTES) / gpu_total_bytes * 100) / 100
        _refuse_if_no_share_fits(args, cfg, gpu_total_bytes, gpu_name, need, kv, least, **kw)
        if share < need + kv:
            fix = f"raise it to at least {least:.2f}"
            raised = replace(cfg, gpu_memory_utilization=least)
            budget = cfg.max_tokens_per_microbatch
            while budget > 256 and not estimate(args, replace(raised, max_tokens_per_microbatch=budget),
                                                gpu_total_bytes, **kw).fits:
                budget //= 2
            if budget != cfg.max_tokens_per_microbatch:
                fix += f" and lower --max-tokens-per-microbatch to {budget} (now {cfg.max_tokens_per_microbatch})"
            raise UserError(f"--gpu-memory-utilization {cfg.gpu_memory_utilization} gives vLLM {share / GIB:.1f} GiB "
                            f"of {gpu_name}, but its bf16 weights are {need / GIB:.1f} GiB and a sequence of "
                            f"--max-model-len {cfg.max_model_len} tokens needs {kv / GIB:.1f} GiB of KV cache: {fix}",
                            EXIT_MEMORY)
    if est.fits:
        return est
    head = (f"the run needs about {est.total / GIB:.1f} GiB of GPU memory but {gpu_name} has "
            f"{gpu_total_bytes / GIB:.1f} GiB ({est.summary()}; {est.tokens_per_microbatch} tokens per micro-batch)")
    fixes = _suggestions(args, cfg, gpu_total_bytes, **kw)
    if fixes:
        raise UserError(f"{head}: {'; or '.join(fixes)}", EXIT_MEMORY)
    lora = kw.get("lora") is not None
    together = _together(args, cfg, gpu_total_bytes, **kw)
    if together:
        raise UserError(f"{head}: no single flag is enough; together: {', '.join(together)}", EXIT_MEMORY)
    others, engines = [], getattr(cfg, "generation_gpus", 0)
    ranks = _ranks_that_fit(args, cfg, gpu_total_bytes, **kw)
    if ranks:
        others.append(f"shard it over {ranks} trainer ranks (torchrun --nproc-per-node {ranks}"
                      + (f" with --generation-gpus {ranks}: {2 * ranks} GPUs)" if engines else ")"))
    if not lora and not engines:  # LoRA is refused with engines on GPUs of their own
        others.append("train LoRA (--lora-rank)")
    raise UserError(f"{head}: the weights and optimizer state alone do not fit; use a GPU with more memory or a "
                    f"smaller model{''.join(', or ' + o for o in others)}", EXIT_MEMORY)


def _ranks_that_fit(args, cfg, gpu_total: int, most: int = 64, **kw) -> int:
    """The fewest trainer ranks (a power of two above this run's, up to `most`) whose FSDP2 shards fit; 0: none."""
    ranks = max(2, 2 * kw.get("shards", 0))
    while ranks <= most:
        if estimate(args, cfg, gpu_total, **{**kw, "shards": ranks}).fits:
            return ranks
        ranks *= 2
    return 0


# -- host memory ------------------------------------------------------------------------------------------


def host_estimate(args, cfg, local_ranks: int = 1, lora=None, shards: int = 0) -> MemoryEstimate:
    """The peak host (CPU) memory of one host, its `local_ranks` ranks together; `gpu_total` of the result is
    0 (the caller compares with the host's memory). P = parameters, c = bytes of the checkpoint's dtype (2):
        LoRA: every rank pins the frozen base of its adapted weights (c x those parameters, packed in 2 GiB
        buffers: spirl.core.pinned; none with --lora-base gpu), and one rank at a time reads the checkpoint (spirl.core.lora): the fused layout in
        process memory, c P, plus the largest tensor being built (the file's pages are page cache, which the
        kernel reclaims: a 5.8 GiB checkpoint read with 4.9 GiB of anonymous memory at the peak and 4.8 GiB of
        file pages mapped), while its base is pinned from those tensors as they are dropped, so that rank peaks
        at c P plus one tensor and the others hold their pinned bases;
        full fine-tuning, FSDP2 (`shards`): every rank reads the checkpoint at once into an fp32 model on its
        CPU before sharding it (2 c P + 4 P each); one process: 2 c P;
        checkpoints: rank 0 gathers what it writes, fp32 masters and AdamW state (12 P; LoRA: 16 B per adapter
        parameter), while the others wait.
    Plus 2 GiB per rank for the Python process, torch and vLLM themselves."""
    p, c = param_count(args), 2
    parts = {"processes": local_ranks * 2 * GIB}
    if lora is not None:
        from torchtitan_compat.lora import lora_param_count

        from weights_vllm_compat import expected_compat_shapes

        shapes = expected_compat_shapes(args)
        pinned, raw = _pinned_base(shapes, args, lora, c) if cfg.lora_base == "host" else (0, 0)
        parts["pinned frozen base"] = local_ranks * pinned
        # the reading rank's own base is pinned out of what it read: its peak beyond that base, plus the largest
        # tensor being built
        largest = max(math.prod(s) for s in shapes.values())
        parts["reading the checkpoint"] = max(c * (p + largest) - raw, 16 * lora_param_count(lora, args))
    else:
        load = local_ranks * (2 * c * p + 4 * p) if shards else 2 * c * p
        parts["reading the checkpoint"] = max(load, 12 * p)
    return MemoryEstimate(parts, 0, 0)


def _pinned_base(shapes: dict, args, lora, c: int) -> tuple[int, int]:
    """(host bytes of one rank's frozen base pinned by spirl.core.pinned.PinnedPool, tensor by tensor in the order
    spirl.core.lora pins them; the bytes of those tensors). `shapes`: the checkpoint's, in the fused layout."""
    from .lora import _adapted_keys
    from .pinned import footprint

    sizes = [c * math.prod(shapes.get(k, shapes["tok_embeddings.weight"])) for k in _adapted_keys(lora, args)]
    return footprint(sizes), sum(sizes)


def check_host(args, cfg, host_total_bytes: int, local_ranks: int = 1, lora=None, shards: int = 0) -> MemoryEstimate:
    """`host_estimate`, or a one-line UserError (exit 5) when it exceeds the host's memory."""
    from .errors import EXIT_MEMORY, UserError

    est = host_estimate(args, cfg, local_ranks, lora, shards)
    if est.total <= host_total_bytes:
        return est
    who = f"{local_ranks} ranks of this host" if local_ranks > 1 else "the run"
    if lora is not None and cfg.lora_base == "host":
        fix = "set --lora-base gpu (the frozen base on the GPUs instead), run fewer ranks per host, or use a host " \
              "with more memory"
    else:
        fix = "run fewer ranks per host or use a host with more memory"
    raise UserError(f"{who} need about {est.total / GIB:.1f} GiB of host memory at the peak ({est.summary()}) but "
                    f"this host has {host_total_bytes / GIB:.1f} GiB: {fix}", EXIT_MEMORY)

