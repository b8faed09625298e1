"""The rollout sweep's host side (`compare/bench_rollout.py --sweep`, issue 39): the grid of decode batch
sizes x prompt lengths, a time estimate that fits the grid into one call's --budget-s, the results as JSON
lines that several calls (invocations of the command) merge into one table, the worst cells and a heatmap.

Nothing here imports torch or vLLM: the engines run in bench_rollout.py's worker processes, and this
module is tested on the CPU with recorded timings (tests/test_rollout_sweep.py).

Terms. A *cell* is (batch B, prompt length P, new tokens G): B fresh prompts of P random ids, each
generating exactly G tokens, so every decode step runs B rows. Its *rollout ratio* is SPIRL's time
over plain vLLM's (> 1: SPIRL slower), the README's "time ratio". Its *decode ratio* is the same for
one decode step, (t_rollout - t_prefill) / (G - 1) on each side, where t_prefill is the same cell
with G = 1 (the prefill and the first token).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# -- the grid -----------------------------------------------------------------------------------------

H100_MAX_NUM_SEQS = 1024
"""vLLM 0.26.0's max_num_seqs for `vllm.LLM` on a GPU of >= 70 GiB that is not an A100 (an H100 80GB):
EngineArgs.get_batch_defaults (vllm/engine/arg_utils.py). Neither bench engine sets it."""
H100_MAX_NUM_BATCHED_TOKENS = 16384
"""vLLM 0.26.0's max_num_batched_tokens for `vllm.LLM` on the same GPUs (same function): the most tokens
of one engine step, so a prefill runs in chunks of at most this many tokens."""


def capture_sizes(max_num_seqs: int = H100_MAX_NUM_SEQS,
                  max_num_batched_tokens: int = H100_MAX_NUM_BATCHED_TOKENS) -> list[int]:
    """The decode batch sizes vLLM 0.26.0 captures CUDA graphs for when none are configured
    (VllmConfig._set_cudagraph_sizes, performance mode "balanced", no speculative decoding):

        top = min(2 * max_num_seqs, 512, max_num_batched_tokens)
        sizes = [1, 2, 4] + [8, 16, ..., 248] + [256, 272, ..., top]   (each <= top)

    plus max_num_batched_tokens itself when it is <= top. With an H100's defaults that is 51 sizes up to
    512 (docs/cold-start.md counted 51 graphs). A decode batch between two sizes replays the larger
    size's graph with padding rows; above the largest it runs eagerly. The worker records the sizes
    its engine really captured, and the report uses those where present."""
    top = min(2 * max_num_seqs, 512, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, min(top + 1, 256), 8))
    sizes += list(range(256, top + 1, 16))
    if max_num_batched_tokens <= top:
        sizes.append(max_num_batched_tokens)
    return sorted(set(sizes))


def odd_sizes(capture: list[int]) -> list[int]:
    """One size just past each capture size that has a gap above it (a + 1 for neighbours a < b,
    b - a > 1): the batch that pads the most rows into the next graph (3 runs the graph of 4, 9 of 16,
    257 of 272)."""
    return [a + 1 for a, b in zip(capture, capture[1:]) if b - a > 1]


DEFAULT_BATCHES = (1, 2, 3, 4, 8, 16, 24, 32, 64, 65, 96, 128, 129, 160, 192, 200, 224, 255, 256, 257,
                   320, 384, 448, 512)
"""The default decode batch sizes (24): the README table's 1/8/64/256; both sides of every
spirl_kernels.gemm.pick_config boundary a decode step reaches (16/24, 64/72, 128/136, 256/272, 512); the issue's
128-256 range every 32 (and 200); and five sizes that are not capture sizes (3, 65, 129, 255, 257).
Under CUDA graphs a decode step's GEMMs run the padded size (17 rows run as 24, 257 as 272): a
decode GEMM's row count is always a capture size, in both engines, and an odd batch adds only the
padded rows' work. `--grid-batches capture,odd` widens the grid to every capture size and one odd size
per gap (100), `1-512` to every size; a wide grid takes several calls of the command (the results file resumes)."""
DEFAULT_PROMPTS = (16, 128, 512, 2048, 8192)
"""The default prompt lengths: 16 to 8k tokens, the README table's 512 and 2048 among them."""
DEFAULT_NEW_TOKENS = 64
"""New tokens per sequence: 63 decode steps after the prefill, 0.2 s at Qwen3-1.7B batch 1."""


def parse_ints(spec: str, what: str, words: str = "") -> list[int]:
    """Sorted distinct positive integers of "A,B,C-D" (C-D: every integer from C to D); `words` names
    what else the flag takes, for the error line."""
    out: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        try:
            lo, _, hi = part.partition("-")
            lo_i, hi_i = int(lo), int(hi or lo)
        except ValueError:
            lo_i, hi_i = 0, -1
        if lo_i < 1 or hi_i < lo_i:
            raise SystemExit(f"error: {what} {spec!r}: expected positive integers or ranges like 1-16{words}, "
                             f"comma-separated, e.g. 16,128,512")
        out.update(range(lo_i, hi_i + 1))
    return sorted(out)


def parse_batches(spec: str, capture: list[int] | None = None) -> list[int]:
    """Decode batch sizes of `--grid-batches`: integers and ranges as `parse_ints`, and the words
    `default` (DEFAULT_BATCHES), `capture` (capture_sizes()) and `odd` (odd_sizes of those)."""
    capture = capture or capture_sizes()
    words = {"default": list(DEFAULT_BATCHES), "capture": capture, "odd": odd_sizes(capture)}
    out: set[int] = set()
    numbers = [p.strip() for p in spec.split(",") if p.strip() not in words]
    for word in (p.strip() for p in spec.split(",") if p.strip() in words):
        out.update(words[word])
    if numbers or not out:
        out.update(parse_ints(",".join(numbers), "--grid-batches", " or the words default, capture, odd"))
    return sorted(out)


@dataclass(frozen=True)
class Cell:
    """One sweep case: `batch` prompts of `prompt_len` random ids, `new_tokens` generated for each."""

    batch: int
    prompt_len: int
    new_tokens: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.prompt_len}x{self.new_tokens}"

    @classmethod
    def of(cls, row: dict) -> "Cell":
        """The cell a results row is of."""
        return cls(batch=int(row["batch"]), prompt_len=int(row["prompt_len"]), new_tokens=int(row["new_tokens"]))


def grid(batches: list[int], prompts: list[int], new_tokens: int) -> list[Cell]:
    """Every (batch, prompt) pair, fewest prompt tokens (B * P) first, then the smaller batch: the order
    the plan takes cells in and the workers run them, so a call cut short by its budget has measured the
    cheap decode-bound cells, and the prefill-heavy ones (large B * P) are what a later call adds."""
    cells = [Cell(batch=b, prompt_len=p, new_tokens=new_tokens) for p in prompts for b in batches]
    return sorted(cells, key=lambda c: (c.batch * c.prompt_len, c.batch))


# -- the time estimate --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """What the estimate needs of a Qwen3 or Qwen3-MoE (config.json's fields). A dense model has no
    experts (`sparse_layers` 0); a Qwen3-MoE's sparse layers hold a router and `experts` experts of width
    `moe_intermediate`, of which each token runs `experts_per_token`."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    sparse_layers: int = 0
    """Layers with experts: not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (the rule of
    transformers' and vLLM's Qwen3-MoE, torchtitan_compat.config.sparse_layer_ids); 0 for a dense Qwen3."""

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelSize":
        """From an HF config.json dict (or torchtitan_compat.config.hf_config_for_shape's)."""
        hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
        moe = {}
        if cfg.get("model_type") == "qwen3_moe":
            step, dense_only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
            moe = {"experts": cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
                   "experts_per_token": cfg["num_experts_per_tok"], "moe_intermediate": cfg["moe_intermediate_size"],
                   "sparse_layers": sum(i not in dense_only and (i + 1) % step == 0 for i in range(layers))}
            if not moe["experts"]:
                moe["sparse_layers"] = 0
        return cls(layers=layers, hidden=hidden, intermediate=cfg["intermediate_size"],
                   heads=heads, kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or hidden // heads, vocab=cfg["vocab_size"], **moe)

    @property
    def expert_params(self) -> int:
        """One expert's weights: gate, up and down, 3 * d * I_moe."""
        return 3 * self.hidden * self.moe_intermediate

    def _layer_params(self, experts_each: float) -> float:
        d, dq = self.hidden, self.heads * self.head_dim
        attention = d * (dq + 2 * self.kv_heads * self.head_dim) + dq * d
        dense_mlp = (self.layers - self.sparse_layers) * 3 * d * self.intermediate
        sparse = self.sparse_layers * (d * self.experts + experts_each * self.expert_params)
        return self.layers * attention + dense_mlp + sparse

    @property
    def layer_params(self) -> int:
        """Linear weights of all decoder layers: L * (d*(Hq+2Hkv)*D + Hq*D*d) (qkv, o) plus 3*d*I (gate_up,
        down) per dense layer and the router d*E and E experts of 3*d*I_moe per sparse layer."""
        return int(self._layer_params(self.experts))

    @property
    def active_layer_params(self) -> int:
        """Decoder weights one token runs through: layer_params with k experts per sparse layer in place of E."""
        return int(self._layer_params(self.experts_per_token))

    @property
    def decode_weight_bytes(self) -> int:
        """bf16 bytes of the weights, 2 * (layer_params + vocab * d) (lm_head included, the embedding not): what
        an engine loads and, for a dense model, what every decode step reads."""
        return 2 * (self.layer_params + self.vocab * self.hidden)

    @property
    def active_weight_bytes(self) -> int:
        """bf16 bytes of the weights one token runs through (a MoE's top-k experts only; dense: all): a decode
        row's FLOPs are this many (2 * params)."""
        return 2 * (self.active_layer_params + self.vocab * self.hidden)

    def experts_read(self, tokens: int) -> float:
        """Experts of one sparse layer that `tokens` tokens route to, expected for routes drawn uniformly:
        E * (1 - (1 - k/E)^T) (8 at one token of 30B-A3B, 52 at 8, 126 at 64). Uniform routes reach the most
        experts; any other routing (a trained model's, a random one's) reaches fewer, so the estimate is on the
        slow side."""
        if not self.sparse_layers:
            return 0.0
        return self.experts * (1 - (1 - self.experts_per_token / self.experts) ** max(tokens, 0))

    def step_weight_bytes(self, tokens: int) -> int:
        """bf16 bytes an engine step of `tokens` tokens reads: every weight of a dense model; of a MoE the
        experts its tokens route to (`experts_read`) and every other weight."""
        every = self.expert_bytes(self.experts)
        return int(self.decode_weight_bytes - every + self.expert_bytes(self.experts_read(tokens)))

    def expert_bytes(self, experts_each: float) -> float:
        """bf16 bytes of `experts_each` experts in every sparse layer."""
        return 2 * self.sparse_layers * experts_each * self.expert_params

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of one token over all layers: 2 * 2 * L * Hkv * D."""
        return 4 * self.layers * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Rates:
    """One H100 80GB's rates behind the estimate, read off the rollout profiles (`git show
    6396e11:docs/rollout-profile.md`; "first" to "fifth run" below are its sections) and docs/cold-start.md
    (2026-11-25/26) and rounded to the slow side: the estimate is for fitting a grid into --budget-s, never
    a measurement. Checked against the fifth run's rollouts (x 512 x 256): decode steps at 1.7B b1/b64/b256
    estimate 2.8/5.1/11.8 ms, against 2.8/4.7/10.3 ms derived from the measured tok/s less the prefill (the
    first profile's 1.7B prefill times; about 40k tokens/s at 8B, fourth run), and at 8B 7.6/10.4/20.9 ms
    against 7.3/9.8/19 ms derived alike."""

    step_floor_s: float = 2.8e-3
    """A decode step's floor: Qwen3-1.7B ran 2.8-3.1 ms a step at batch 1 and 8 (357 and 2,604 tok/s,
    fifth run), above its 3.4 GB of weights at HBM speed (host and launch work)."""
    weight_bytes_per_s: float = 2.0e12
    """Weights streamed by a decode step: Qwen3-8B's 15.1 GB at batch 1 in 7.3 ms (137.6 tok/s, fifth run)."""
    gemm_flops_per_s: float = 4.0e14
    """Decode GEMMs once compute-bound (batch x 2 x params FLOPs a step)."""
    prefill_flops_per_s: float = 5.0e14
    """Prefill: 1.7B's 131k prompt tokens took 952 ms (~400 TFLOP/s, first profile); the persistent GEMM
    ran at ~680 TFLOP/s at thousands of rows (fourth run)."""
    moe_prefill_flops_per_s: float = 2.5e14
    """A MoE's expert GEMMs in a prefill (vLLM's fused_moe_kernel): not measured, half the dense rate (each of
    30B-A3B's experts gets 1/16 of the tokens, in row tiles padded per expert)."""
    kv_bytes_per_s: float = 2.5e12
    """KV cache read by decode attention (HBM3 3.35 TB/s peak; FA3 took 60 % of plain's 9.0 ms b256 step)."""
    per_sequence_s: float = 6e-6
    """Per sequence and decode step: sampling, logprobs and the scheduler's bookkeeping."""
    prompt_token_s: float = 5e-8
    """Host time to draw one random prompt id and hand it to vLLM (torch.randint + tolist + TokensPrompt)."""
    engine_start_s: float = 60.0
    """An engine's start with empty kernel caches, before its weights: imports, profile run, 51 graph
    captures and Triton JIT (docs/cold-start.md: 47.6-53.2 s cold at 1.7B; plain's torch.compile: 66 s
    at 1.7B, 82 s at 8B, the profiles' second and third runs)."""
    engine_start_s_per_weight_gb: float = 2.0
    """Start time per GB of bf16 weights (loading, and torch.compile's longer graphs at 8B)."""
    compile_start_s: float = 30.0
    """What plain vLLM's start adds to it, cold: torch.compile (66 s at 1.7B against SPIRL's engine's 47.6-53.2 s;
    82 s at 8B) and, on a MoE, its fused-MoE kernels JIT-compiled for each of its tuned configs; rounded up for a
    48-layer MoE, not measured there."""
    weight_load_s_per_gb: float = 0.5
    """Start time per GB of a MoE's experts beyond the ones a token runs (loading only; their kernels and graphs
    are the active ones'): not measured, a guess on the slow side for safetensors read from the page cache."""
    checkpoint_s_per_gb: float = 3.0
    """Writing the random checkpoint (weights.py --random) when the call has none yet."""
    gpu_bytes: float = 81559 * 2**20
    """An H100 80GB HBM3's memory (nvidia-smi: 81559 MiB); the sweep uses its GPU's own (`gpu_memory_bytes`)."""
    reserved_bytes: float = 6e9
    """What vLLM keeps besides weights and KV cache (activations of its 16,384-token profile run, graphs)."""


def decode_step_seconds(size: ModelSize, rates: Rates, batch: int, context: float) -> float:
    """One decode step of `batch` rows at `context` tokens each:
    max(floor, W / bw_w, B * 2 * params / flops) + B * context * kv_bytes / bw_kv + B * per_sequence,
    where a MoE's W is the weights its B tokens route to and its params those one token runs through."""
    gemm = max(rates.step_floor_s, size.step_weight_bytes(batch) / rates.weight_bytes_per_s,
               batch * size.active_weight_bytes / rates.gemm_flops_per_s)  # 2 * params == bf16 bytes
    attention = batch * context * size.kv_bytes_per_token / rates.kv_bytes_per_s
    return gemm + attention + batch * rates.per_sequence_s


def prefill_seconds(size: ModelSize, rates: Rates, batch: int, prompt_len: int,
                    chunk_tokens: int = H100_MAX_NUM_BATCHED_TOKENS) -> float:
    """The prefill of `batch` prompts of P tokens: B * P * (2 * params + 2 * L * Hq * D * P) FLOPs
    (linears, then causal attention over P/2 keys on average; a MoE's params those one token runs through) at
    the prefill rate (a MoE's experts at their own), plus one step floor per chunk of `chunk_tokens`, plus the
    host's prompt handling; for a MoE also each chunk's read of the experts its tokens route to (at 16 prompt
    tokens 82 of 30B-A3B's 128 experts a layer: the weights, not the FLOPs, are a short prefill's cost)."""
    tokens = batch * prompt_len
    attention = 2 * size.layers * size.heads * size.head_dim * prompt_len
    experts_flops = tokens * size.expert_bytes(size.experts_per_token)  # 2 * params == bf16 bytes
    flops = tokens * (2 * size.active_layer_params + attention) + batch * 2 * size.vocab * size.hidden - experts_flops
    chunks = math.ceil(tokens / chunk_tokens)
    full, rest = divmod(tokens, chunk_tokens)
    experts = full * size.expert_bytes(size.experts_read(chunk_tokens)) + size.expert_bytes(size.experts_read(rest))
    return (flops / rates.prefill_flops_per_s + experts_flops / rates.moe_prefill_flops_per_s
            + chunks * rates.step_floor_s + tokens * rates.prompt_token_s + experts / rates.weight_bytes_per_s)


def rollout_seconds(size: ModelSize, rates: Rates, cell: Cell, new_tokens: int | None = None) -> float:
    """One generate() of the cell (with `new_tokens` in place of the cell's, for the warm-up and the
    prefill timing): the prefill, then G - 1 decode steps at the mean context P + G / 2."""
    g = cell.new_tokens if new_tokens is None else new_tokens
    steps = max(g - 1, 0)
    return (prefill_seconds(size, rates, cell.batch, cell.prompt_len)
            + steps * decode_step_seconds(size, rates, cell.batch, cell.prompt_len + g / 2))


WARMUP_NEW_TOKENS = 8
"""New tokens of a cell's untimed warm-up run (fewer if the cell has fewer): its prefill shapes JIT-compiled
and its decode steps replayed before any timing (bench_rollout.py's warm-up since issue 28)."""


def cell_seconds(size: ModelSize, rates: Rates, cell: Cell, repeats: int, split_prefill: bool) -> float:
    """One engine's time for one cell: the warm-up, then `repeats` x (the rollout, and its prefill
    alone when `split_prefill`)."""
    timed = rollout_seconds(size, rates, cell)
    if split_prefill:
        timed += rollout_seconds(size, rates, cell, 1)
    return rollout_seconds(size, rates, cell, min(cell.new_tokens, WARMUP_NEW_TOKENS)) + repeats * timed


def engine_start_seconds(size: ModelSize, rates: Rates, compiled: bool = False) -> float:
    """One engine's start: the base start plus a part that grows with the weights a token runs through (its
    graphs' work); a MoE's other experts add only their loading; `compiled` (plain vLLM's torch.compile) adds
    `Rates.compile_start_s`."""
    idle_experts = size.decode_weight_bytes - size.active_weight_bytes
    return (rates.engine_start_s + rates.engine_start_s_per_weight_gb * size.active_weight_bytes / 1e9
            + rates.weight_load_s_per_gb * idle_experts / 1e9 + (rates.compile_start_s if compiled else 0.0))


def gpu_memory_bytes(run=subprocess.run) -> float | None:
    """The memory of the GPUs this process may use (nvidia-smi's memory.total of each, the smallest; the first
    CUDA_VISIBLE_DEVICES entry where it names one by index), in bytes; None where nvidia-smi is not there or says
    nothing usable (the estimate then assumes `Rates.gpu_bytes`, an H100's). The parent never initializes CUDA
    itself: its workers need all of the GPU's memory."""
    cmd = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.isdigit():
        cmd.append(f"--id={first}")
    try:
        out = run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
        mib = [float(v) for v in out.split()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return min(mib) * 2**20 if mib else None


def kv_tokens_estimate(size: ModelSize, rates: Rates, gpu_memory_utilization: float) -> int:
    """KV-cache tokens the engine will have: (memory * utilization - weights - reserved) / kv bytes per
    token. The worker reads the real number from its engine; this is for planning only."""
    free = rates.gpu_bytes * gpu_memory_utilization - size.decode_weight_bytes - rates.reserved_bytes
    return max(int(free // size.kv_bytes_per_token), 0)


KV_BLOCK_TOKENS = 16
"""vLLM 0.26's default KV block size on CUDA (the worker uses its engine's own)."""
KV_MARGIN = 0.95
"""Fraction of the KV cache a cell may fill: a fuller cache may preempt a sequence (recomputing it) and
then the decode batch is no longer B."""


def fits_kv(cell: Cell, kv_tokens: int | None, block: int = KV_BLOCK_TOKENS) -> bool:
    """Whether all B sequences fit in the KV cache at once at their full length:
    B * ceil((P + G) / block) * block <= KV_MARGIN * kv_tokens (None: unknown, assumed to fit)."""
    if kv_tokens is None:
        return True
    need = cell.batch * math.ceil((cell.prompt_len + cell.new_tokens) / block) * block
    return need <= KV_MARGIN * kv_tokens


@dataclass
class Plan:
    """Which cells of a grid one call runs, and the estimate behind it."""

    cells: list[Cell]
    """Cells that fit the budget and the KV cache, in the order given."""
    over_budget: list[Cell]
    """Cells left for a later call (the results file resumes them)."""
    no_kv: list[Cell]
    """Cells whose B sequences do not fit the estimated KV cache at once (the worker re-checks)."""
    fixed_s: float
    """Time outside the cells: the checkpoint (if written) and every engine's start."""
    cells_s: float
    """Estimated time of the planned cells over all engines."""


def plan(cells: list[Cell], size: ModelSize, rates: Rates, budget_s: float, n_engines: int, repeats: int,
         split_prefill: bool, kv_tokens: int | None, write_checkpoint: bool = False, compiled: int = 0) -> Plan:
    """Take cells in the given (grid) order while the estimate stays within `budget_s`:
    checkpoint + n_engines * (start + sum of cell_seconds) <= budget_s, `compiled` of the engines starting
    with torch.compile (`engine_start_seconds`). A cell that does not fit is left for later and smaller ones
    after it may still be taken."""
    fixed = n_engines * engine_start_seconds(size, rates) + compiled * rates.compile_start_s
    if write_checkpoint:
        fixed += rates.checkpoint_s_per_gb * size.decode_weight_bytes / 1e9
    kept, over, no_kv, used = [], [], [], fixed
    for cell in cells:
        if not fits_kv(cell, kv_tokens):
            no_kv.append(cell)
            continue
        cost = n_engines * cell_seconds(size, rates, cell, repeats, split_prefill)
        if used + cost <= budget_s:
            kept.append(cell)
            used += cost
        else:
            over.append(cell)
    return Plan(cells=kept, over_budget=over, no_kv=no_kv, fixed_s=fixed, cells_s=used - fixed)


def engine_deadline(now: float, end: float, starts: list[float]) -> float:
    """The deadline of the next engine of a sweep whose engines run one after the other: `starts` are the start
    estimates of it and of the engines after it, which run the cells it measured. Each gets its own start and an
    equal share of the rest, now + starts[0] + (end - now - sum(starts)) / len(starts) (with equal starts,
    (end - now) / len(starts) from now), so an engine that starts fast does not measure cells that a slower one
    after it has no time left for (plain vLLM's torch.compile: `Rates.compile_start_s`). Never after `end`."""
    return min(now + starts[0] + max(end - now - sum(starts), 0.0) / len(starts), end)


@dataclass
class Deadline:
    """A worker's clock: it starts a cell only if the estimate, scaled by the worst measured / estimated
    ratio of the cells it has run (at least 1), still ends before `at` (time.time() seconds)."""

    at: float
    scale: float = 1.0
    """max(1, measured / estimated) over the cells run so far."""

    def allows(self, now: float, estimate_s: float) -> bool:
        return now + self.scale * estimate_s <= self.at

    def record(self, measured_s: float, estimate_s: float) -> None:
        if estimate_s > 0:
            self.scale = max(self.scale, measured_s / estimate_s)


# -- results: JSON lines, merged over calls ------------------------------------------------------------

REFERENCE = "plain"
"""The engine every other engine's time is divided by."""


def append_rows(path: str | Path, rows: list[dict]) -> None:
    """Append rows as JSON lines and flush them to disk, so a call killed at its limit keeps every row
    written before. A last line cut off by such a kill is ended first, so the next call's first row
    starts a line of its own (load_rows skips the cut one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        for row in rows:
            f.write((json.dumps(row, sort_keys=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


REQUIRED = {"engine": ("engine", "run_id"),
            "cell": ("engine", "run_id", "shape", "batch", "prompt_len", "new_tokens", "seconds"),
            "skip": ("engine", "run_id", "shape", "batch", "prompt_len", "new_tokens"),
            "fail": ("engine", "run_id", "shape", "batch", "prompt_len", "new_tokens")}
"""The keys each kind of row must have to be read (a row missing one is skipped)."""


def load_rows(paths: list[str | Path]) -> list[dict]:
    """Every complete row of every results file that exists, in order (a missing file is an empty one;
    a blank, cut-off or incomplete line is skipped)."""
    rows = []
    for path in map(Path, paths):
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and all(k in row for k in REQUIRED.get(row.get("kind"), ("?",))):
                rows.append(row)
    return rows


def decode_step_s(row: dict) -> float | None:
    """(t_rollout - t_prefill) / (G - 1) of a cell row, or None when the prefill was not timed, G is
    1, or the decode is under a tenth of the rollout (a difference of two near-equal timings)."""
    prefill, total, g = row.get("prefill_seconds"), row.get("seconds"), row.get("new_tokens", 1)
    if prefill is None or total is None or g < 2 or total - prefill < 0.1 * total:
        return None
    return (total - prefill) / (g - 1)


@dataclass
class Pair:
    """One cell measured by an engine and by the reference in the same call."""

    label: str
    shape: str
    engine: str
    cell: Cell
    ours: dict
    plain: dict
    capture: list[int] = field(default_factory=list)
    """The capture sizes the engine recorded in that call (empty: unknown)."""

    @property
    def rollout_ratio(self) -> float:
        return self.ours["seconds"] / self.plain["seconds"]

    @property
    def decode_ratio(self) -> float | None:
        a, b = decode_step_s(self.ours), decode_step_s(self.plain)
        return a / b if a and b else None

    @property
    def pair_ratios(self) -> list[float]:
        """Run i of `ours` over run i of the reference, for a `--paired` cell (their runs alternate, so
        run i of each shared the host's minute); empty for an unpaired cell or runs of unequal count."""
        a, b = self.ours.get("seconds_each") or [], self.plain.get("seconds_each") or []
        if not (self.ours.get("paired") and self.plain.get("paired")) or len(a) != len(b) or not all(b):
            return []
        return [x / y for x, y in zip(a, b)]

    def every_pair_misses(self, goal: float) -> bool:
        """A paired cell whose every run pair is above `goal`: a miss the host's noise does not explain
        (a median above it with some pairs below is a miss that noise may have made)."""
        return bool(self.pair_ratios) and min(self.pair_ratios) > goal

    @property
    def captured(self) -> bool | None:
        return self.cell.batch in self.capture if self.capture else None


def pairs(rows: list[dict], engine: str = "ours") -> list[Pair]:
    """Per (label, shape, cell): `engine`'s and the reference's cell rows from one call (run_id), the
    latest call that has both. Two calls are never mixed: a ratio compares timings of one machine."""
    capture = {(r["run_id"], r["engine"]): r.get("capture_sizes") or [] for r in rows if r["kind"] == "engine"}
    by_run: dict[tuple, dict[str, dict]] = {}
    order: dict[tuple, int] = {}
    for i, r in enumerate(rows):
        if r["kind"] != "cell" or r["engine"] not in (engine, REFERENCE):
            continue
        key = (r.get("label", ""), r["shape"], Cell.of(r), r["run_id"])
        by_run.setdefault(key, {})[r["engine"]] = r
        order[key] = i
    latest: dict[tuple, tuple] = {}
    for key in sorted(by_run, key=order.get):
        if engine in by_run[key] and REFERENCE in by_run[key]:
            latest[key[:3]] = key
    out = []
    for (label, shape, cell), key in latest.items():
        got = by_run[key]
        out.append(Pair(label, shape, engine, cell, got[engine], got[REFERENCE],
                        capture.get((key[3], engine)) or []))
    return sorted(out, key=lambda p: (p.label, p.shape, p.engine, p.cell.prompt_len, p.cell.batch))


def done_cells(rows: list[dict], label: str, shape: str, engines: list[str], retry_failed: bool = False) -> set[Cell]:
    """Cells a resumed sweep skips: measured by every engine in one call; or, unless `retry_failed`, one
    that crashed an engine (a `fail` row: rerunning it would stop the call at the same cell again) or
    did not fit an engine's KV cache (a `skip` row)."""
    runs: dict[tuple, set[str]] = {}
    given_up = set()
    for r in rows:
        if r.get("label", "") != label or r.get("shape") != shape or "batch" not in r:
            continue
        if r["kind"] == "cell":
            runs.setdefault((Cell.of(r), r["run_id"]), set()).add(r["engine"])
        elif r["kind"] in ("fail", "skip") and not retry_failed:
            given_up.add(Cell.of(r))
    return {cell for (cell, _), got in runs.items() if set(engines) <= got} | given_up


# -- report: worst cells, misses, heatmap --------------------------------------------------------------

GOAL = 1.05
"""The issue's goal: no cell's rollout ratio above 1.05."""


def fmt_ratio(x: float | None) -> str:
    return f"{x:.3f}x" if x is not None else "-"


def print_ratio_table(rows: list[dict], key: str, header: str, line: Callable[[dict], str], what: str,
                      limit: float = GOAL, tail: str = "") -> None:
    """Two engines' measurements side by side, one row per cell (compare/rollout_steps.py and
    compare/profile_decode.py `--report`): the header, `line(row)` for each row (flagged `above` where its `key`
    ratio is above `limit`), then the worst row by `key` and how many are above `limit`; `tail` ends that line."""
    print(header)
    for r in rows:
        print(line(r) + ("  above" if r[key] > limit else ""))
    worst = max(rows, key=lambda r: r[key])
    above = sum(r[key] > limit for r in rows)
    print(f"{len(rows)} cells; {what} worst {worst[key]:.3f}x at {worst['batch']} x {worst['prompt']}, "
          f"{above} above {limit:.2f}x{tail}")


def report_lines(all_pairs: list[Pair], worst: int = 10, goal: float = GOAL) -> list[str]:
    """Per (label, shape): the cell count, the worst cell, every cell above `goal` (the misses, worst
    first) and then the rest of the `worst` slowest cells; one line per cell. For `--paired` cells the
    `pairs` column gives the range of the per-run-pair ratios and a miss above `goal` in every pair is
    flagged `MISS (every pair)`: on a host-bound shape a median can miss by noise alone."""
    lines = []
    groups: dict[tuple[str, str, str], list[Pair]] = {}
    for p in all_pairs:
        groups.setdefault((p.label, p.shape, p.engine), []).append(p)
    for (label, shape, engine), group in groups.items():
        ranked = sorted(group, key=lambda p: -p.rollout_ratio)
        misses = [p for p in ranked if p.rollout_ratio > goal]
        head = f"{shape}{f' [{label}]' if label else ''}: {engine} / {REFERENCE}, {len(group)} cells"
        every = sum(p.every_pair_misses(goal) for p in misses)
        paired = any(p.pair_ratios for p in group)
        lines.append(f"{head}; worst {fmt_ratio(ranked[0].rollout_ratio)} at batch {ranked[0].cell.batch} x prompt "
                     f"{ranked[0].cell.prompt_len}; {len(misses)} above {goal:.2f}x"
                     + (f" ({every} of them in every run pair)" if paired and misses else ""))
        lines.append(f"  {'batch':>5s} {'prompt':>6s} {'new':>4s} {'ours s':>8s} {'plain s':>8s} {'rollout':>8s} "
                     f"{'decode':>8s} {'spread':>7s} {'pairs':>11s}  capture size")
        shown = misses + [p for p in ranked[:worst] if p not in misses]
        for p in shown:
            cap = {True: "yes", False: "no (padded)", None: "?"}[p.captured]
            flag = ("  MISS (every pair)" if p.every_pair_misses(goal) else "  MISS") if p.rollout_ratio > goal else ""
            pr = p.pair_ratios
            pairs_col = f"{min(pr):.2f}-{max(pr):.2f}" if pr else "-"
            lines.append(f"  {p.cell.batch:5d} {p.cell.prompt_len:6d} {p.cell.new_tokens:4d} {p.ours['seconds']:8.3f} "
                         f"{p.plain['seconds']:8.3f} {fmt_ratio(p.rollout_ratio):>8s} {fmt_ratio(p.decode_ratio):>8s} "
                         f"{spread(p.ours):>7s} {pairs_col:>11s}  {cap}{flag}")
    return lines


def spread(row: dict) -> str:
    """(slowest - fastest) / median of a row's repeats, as a percentage; "-" for a single timing."""
    each = row.get("seconds_each") or []
    if len(each) < 2 or statistics.median(each) <= 0:  # one timing, or runs too short to round above 0
        return "-"
    return f"{100 * (max(each) - min(each)) / statistics.median(each):.1f}%"


def heatmap(all_pairs: list[Pair], out: str | Path, goal: float = GOAL) -> Path:
    """One PNG: a row of panels per (label, shape), the rollout ratio and (when a cell timed its prefill,
    --split-prefill) the decode ratio, batch sizes
    across (ticks of sizes that are not capture sizes end in '*'), prompt lengths up; colour centred on
    1.0 (blue: SPIRL faster, red: slower), every value written in its cell, misses (> goal) boxed.
    Needs matplotlib (the `plot` extra); Agg backend, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    groups: dict[tuple[str, str, str], list[Pair]] = {}
    for p in all_pairs:
        groups.setdefault((p.label, p.shape, p.engine), []).append(p)
    if not groups:
        raise ValueError("no cell was measured by both engines in one call: nothing to plot")
    widest = max(len({p.cell.batch for p in g}) for g in groups.values())
    metrics = ("rollout", "decode step") if any(p.decode_ratio is not None for p in all_pairs) else ("rollout",)
    fig = Figure(figsize=(max(8.0, 0.42 * widest * len(metrics) + 2), 3.2 * len(groups)), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups), len(metrics), squeeze=False)
    norm = TwoSlopeNorm(vmin=0.8, vcenter=1.0, vmax=1.3)
    mesh = None
    for row_axes, ((label, shape, engine), group) in zip(axes, groups.items()):
        batches = sorted({p.cell.batch for p in group})
        prompts = sorted({p.cell.prompt_len for p in group})
        capture = next((p.capture for p in group if p.capture), [])
        for ax, metric in zip(row_axes, metrics):
            values = [[float("nan")] * len(batches) for _ in prompts]
            for p in group:
                v = p.rollout_ratio if metric == "rollout" else p.decode_ratio
                if v is not None:
                    values[prompts.index(p.cell.prompt_len)][batches.index(p.cell.batch)] = v
            mesh = ax.imshow(values, cmap="RdBu_r", norm=norm, aspect="auto", origin="lower")
            for yi, line in enumerate(values):
                for xi, v in enumerate(line):
                    if math.isnan(v):
                        continue
                    ax.text(xi, yi, f"{v:.2f}", ha="center", va="center", fontsize=5.5,
                            color="white" if abs(v - 1.0) > 0.18 else "black")
                    if v > goal:
                        ax.add_patch(Rectangle((xi - 0.5, yi - 0.5), 1, 1, fill=False, lw=1.2, ec="black"))
            ax.set_xticks(range(len(batches)))
            ax.set_xticklabels([f"{b}{'' if not capture or b in capture else '*'}" for b in batches],
                               rotation=90, fontsize=6)
            ax.set_yticks(range(len(prompts)))
            ax.set_yticklabels([str(p) for p in prompts], fontsize=7)
            ax.set_xlabel("decode batch size (* not a CUDA-graph capture size)", fontsize=7)
            ax.set_ylabel("prompt tokens", fontsize=7)
            worst = max((v for line in values for v in line if not math.isnan(v)), default=float("nan"))
            ax.set_title(f"{shape}{f' [{label}]' if label else ''}: {metric} time, {engine} / {REFERENCE} "
                         f"(worst {worst:.2f}x; boxed > {goal:.2f}x)", fontsize=8)
    fig.colorbar(mesh, ax=axes, shrink=0.8, label="time ratio (SPIRL / plain vLLM)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    return out
