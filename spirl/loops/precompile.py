"""Compile a run's Triton kernels at start-up, so neither the first rollout nor the first step does (issue 39).

Triton compiles a kernel the first time it meets a new *key*: the kernel's constexprs (tile configs chosen from
the shapes), num_warps/num_stages, each integer argument's specialization (1, a multiple of 16, or neither), and
the shapes of its TMA boxes (the warp-specialized GEMM's row tails: `spirl_kernels.gemm.compile_key`).
On a cold cache (a new machine, a new Triton) step 1 of a GRPO run used to compile ~9 s of the trainer's
backward kernels inside the step, and the first rollout compiled the engine's prefill kernels at each new token
count (docs/cold-start.md). A warm cache loads them in milliseconds, but the loads still happen inside step 1.

`precompile` runs the run's own code paths on a few synthetic batches before step 1, at the token counts where
a key can change (`key_rows`), so every key is built then:
  * engine: one `generate` of one new token per prompt set, prefills of T tokens for T in the rows up to the
    engine's token budget (vLLM's real path: our GEMMs and norms, FA3, the sampler). Decode steps need nothing:
    vLLM captures their CUDA graphs, running every kernel, at start-up;
  * trainer: for each T up to --max-tokens-per-microbatch, the parity check's no-grad forward and a training
    micro-batch's forward + backward (the run's loss options, so the same kernel variants), weighted 0.

Nothing it does reaches the math: the engine's requests carry their own sampling seed (vLLM seeds each
request's generator from it), the backward's gradients are exact zeros and are dropped, no optimizer step is
taken, no RNG is drawn. tests/test_precompile.py checks that a run's checkpoints and metrics are the same bytes
with and without it. It runs with `--precompile 1` on a GPU; the run logs how many kernels it built (compiled or
loaded from TRITON_CACHE_DIR), in how long, and where the time went. Every step logs `triton/builds`, the kernels
built during that step, with or without it (and names them in the log when there are any).

What it costs and saves (H100, 2026-11-26, docs/cold-start.md): step 1 is 0.9-1.25x the steady step with it, cold
cache included (2.4x cold without it at Qwen3-1.7B full fine-tuning). But each of its ~29 trainer passes costs
~0.3 s of kernel launches even with every kernel cached (LoRA at 1.7B: 8.4 s of 9.2 s), so it adds 9-17 s to a
warm start and 26-33 s to a cold one, more than the 6-10 s of compiles it takes out of a cold step 1. Hence off
by default. The cheaper design, compiling the same keys with Triton's compile-only `JITFunction.warmup` (no
GPU passes), is in docs/cold-start.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

import torch

log = logging.getLogger("spirl.loops.precompile")

SEQ_COUNTS = (1, 3, 16)
"""Sequence counts of the extra batches at two token counts (one a multiple of 16, one not): kernels that take
the number of sequences as an integer (attention backward's preprocessing, the sampler's rows) specialize on
it (1, a multiple of 16, neither) as they do on the token count."""


class TritonBuilds:
    """Counts the Triton kernels this process builds (compiles, or loads from the disk cache) while entered:
    Triton's `knobs.runtime.jit_post_compile_hook`, chained to the hook already there (vLLM installs a JIT
    monitor after its warm-up, so enter this after the engine is built). `names` (kernel name -> builds) grows;
    `count` is their total and `since(mark)` the builds after an earlier `count`; `variants` lists each build's
    specialization as Triton prints it (argument types, `D` where a pointer or integer is taken to be divisible by
    16), in build order. Without the hook (another Triton), `available` is False and nothing is counted."""

    def __init__(self):
        self.names: Counter = Counter()
        self.variants: list[str] = []
        self.available = False
        self._previous = None

    def __enter__(self) -> "TritonBuilds":
        try:
            from triton import knobs

            self._previous = knobs.runtime.jit_post_compile_hook
        except (ImportError, AttributeError):
            return self
        previous = self._previous

        def hook(**kwargs):
            self.names[getattr(kwargs.get("fn"), "name", "?")] += 1
            self.variants.append(str(kwargs.get("repr", "?")))
            return previous(**kwargs) if previous is not None else None

        self._hook = hook
        knobs.runtime.jit_post_compile_hook = hook
        self.available = True
        return self

    def __exit__(self, *exc) -> None:
        if not self.available:
            return
        from triton import knobs

        if knobs.runtime.jit_post_compile_hook is self._hook:  # someone chained after us: leave theirs in place
            knobs.runtime.jit_post_compile_hook = self._previous
        self.available = False

    @property
    def count(self) -> int:
        return sum(self.names.values())

    def since(self, mark: int) -> int:
        return self.count - mark


# -- which token counts -------------------------------------------------------------------------------------


def linear_shapes(model_args) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(N, K) of the model's distinct decoder-layer linears (fused qkv, o, fused gate_up, down; Qwen3-MoE: the router,
    and the dense MLP's only where some layer is dense), and of lm_head."""
    import weights_vllm_compat

    from torchtitan_compat.config import sparse_layers

    shapes = weights_vllm_compat.linear_shapes(model_args)
    head = shapes.pop("lm_head")
    sparse = sparse_layers(model_args)
    if sparse:
        shapes["router"] = (model_args.moe_args.num_experts, model_args.dim)
        if len(sparse) == model_args.n_layers:
            del shapes["gate_up"], shapes["down"]
    return sorted(set(shapes.values())), head


def key_rows(shapes: list[tuple[int, int]], limit: int) -> list[int]:
    """The fewest row counts up to `limit`, in order, that give every key the batch-invariant GEMM can take
    over `shapes` for 1..limit rows: for each (N, K), `spirl_kernels.gemm.compile_key` (the tile config, the row
    count's Triton specialization, the warp-specialized kernels' row-tail boxes). A row count is kept when it is
    the first to give some shape a new key. Pure Python (no GPU)."""
    from spirl_kernels.gemm import compile_key

    seen: set = set()
    rows = []
    for m in range(1, limit + 1):
        keys = {compile_key(m, n, k) for n, k in shapes}
        if not keys <= seen:
            seen |= keys
            rows.append(m)
    return rows


def lengths_for(total: int, longest: int, n_seqs: int | None = None) -> list[int]:
    """Sequence lengths (each 2..longest) summing to `total` tokens: as few sequences as fit, or `n_seqs` of them
    (as even as possible). Empty when no such split exists."""
    n = n_seqs or max(1, math.ceil(total / longest))
    if n * 2 > total or math.ceil(total / n) > longest:
        return []
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def batches(rows: list[int], longest: int) -> list[list[int]]:
    """The synthetic batches (each a list of sequence lengths): one per row count, plus SEQ_COUNTS sequences at
    the first row count that is a multiple of 16 and the first that is not (both from 32 tokens up)."""
    out = [ls for t in rows if (ls := lengths_for(t, longest))]
    for want in (True, False):
        t = next((t for t in rows if t >= 32 and (t % 16 == 0) == want), None)
        for n in SEQ_COUNTS if t else ():
            ls = lengths_for(t, longest, n)
            if ls and ls not in out:
                out.append(ls)
    return out


# -- running them -------------------------------------------------------------------------------------------


def engine_batches(model_args, budget: int, longest: int) -> list[list[int]]:
    """Prompt lengths of the engine's warm-up prefills: the decoder layers' GEMMs see the step's T tokens."""
    return batches(key_rows(linear_shapes(model_args)[0], budget), longest)


def trainer_batches(model_args, budget: int, longest: int) -> list[list[int]]:
    """Sequence lengths of the trainer's warm-up micro-batches (each sequence one prompt token, the rest sampled):
    the decoder layers' GEMMs see all T tokens, lm_head only the rows that predict a sampled token (T minus
    one per sequence), so its row counts get batches of their own."""
    body, head = linear_shapes(model_args)
    out = batches(key_rows(body, budget), longest)
    for r in key_rows([head], budget - 1):
        n = max(1, math.ceil(r / (longest - 1)))
        lengths = lengths_for(r + n, longest, n)
        if lengths and lengths not in out:
            out.append(lengths)
    return out


def warm_engine(engine, model_args, longest: int) -> int:
    """Prefills of every key row count up to the engine's token budget, one new token each (see the module
    doc). Returns the prompts sent. Engines without `prefill_budget` (the native engine) are skipped."""
    budget = getattr(engine, "prefill_budget", None)
    if budget is None:
        return 0
    tokens, seqs = budget()
    sets = [ls for ls in engine_batches(model_args, tokens, longest) if len(ls) <= seqs]
    for lengths in sets:
        engine.generate([[1] * n for n in lengths], max_tokens=1, seed=0)
    return sum(map(len, sets))


def warm_trainer(policy, cfg, device, model_args) -> dict:
    """The parity forward and a training micro-batch's forward + backward (loss weight 0) at every key row count
    up to the micro-batch budget, then every gradient dropped. Returns {tokens, forward_s, backward_s, slowest}:
    the tokens run, the seconds of the no-grad forwards and of the forward + backward passes, and the slowest
    batch as (tokens, sequences, seconds)."""
    from ..numerics.parity import sampled_logprobs
    from ..numerics.samples import Sample
    from .loss import sequence_weights
    from .update import micro_batch_loss, sampling_dist

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    out = {"tokens": 0, "forward_s": 0.0, "backward_s": 0.0, "slowest": (0, 0, 0.0)}
    for lengths in trainer_batches(model_args, cfg.max_tokens_per_microbatch, cfg.max_model_len):
        samples = [Sample([1], [1] * (n - 1), torch.zeros(n - 1), "stop") for n in lengths]
        weights = sequence_weights(cfg.loss_type, [n - 1 for n in lengths], [False] * len(lengths),
                                   cfg.max_new_tokens, bool(cfg.mask_truncated_completions))
        old = [s.logprobs for s in samples]
        t0 = sync()
        with torch.no_grad():
            sampled_logprobs(policy.model, samples, device, sampling_dist(cfg))
        t1 = sync()
        ref = old if policy.has_reference else None
        loss, _ = micro_batch_loss(policy, samples, old, ref, torch.ones(len(samples)), weights, cfg, device)
        (loss * 0.0).backward()
        t2 = sync()
        out["tokens"] += sum(lengths)
        out["forward_s"] += t1 - t0
        out["backward_s"] += t2 - t1
        if t2 - t0 > out["slowest"][2]:
            out["slowest"] = (sum(lengths), len(lengths), t2 - t0)
    policy.model.zero_grad(set_to_none=True)
    for p in policy.masters.values():
        p.grad = None
    return out


def wanted(cfg, device) -> bool:
    """Whether a run precompiles: --precompile 1 on a GPU (Triton kernels exist only there)."""
    return bool(cfg.precompile) and device.type == "cuda"


def precompile(engine, policy, cfg, device, model_args, builds: TritonBuilds) -> dict:
    """Both warm-ups; logs and returns what they built: {precompile/seconds, precompile/triton_builds}."""
    t0, mark = time.perf_counter(), builds.count
    prompts = warm_engine(engine, model_args, cfg.max_model_len - 1)
    engine_builds, t1 = builds.since(mark), time.perf_counter()
    tr = warm_trainer(policy, cfg, device, model_args)
    t2 = time.perf_counter()
    out = {"precompile/seconds": t2 - t0, "precompile/triton_builds": builds.since(mark)}
    n, seqs, slow = tr["slowest"]
    log.info("precompiled: %d Triton kernels built in %.1f s (engine: %d prompts, %d kernels, %.1f s; trainer: %d "
             "tokens, %d kernels, %.1f s: no-grad forwards %.1f s, forward + backward %.1f s, slowest batch %d tokens "
             "in %d sequences %.2f s)%s", out["precompile/triton_builds"], t2 - t0, prompts, engine_builds, t1 - t0,
             tr["tokens"], builds.since(mark) - engine_builds, t2 - t1, tr["forward_s"], tr["backward_s"], n, seqs,
             slow, "" if builds.available else " (this Triton has no build hook: counts unknown)")
    return out
