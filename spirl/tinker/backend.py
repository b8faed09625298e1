"""The Tinker API's engine room: one base model, its rollout engine and its policy, one worker thread.

Every call of the clients (spirl/tinker/clients.py) becomes a task on one worker thread, so training
operations apply in the order they were submitted, whatever order their futures are awaited in
(Tinker's semantics; tinker-cookbook relies on it). Sampling requests that queue up together are
run as one engine call (the cookbook sends one `sample` per environment, all at once).

Weights versions. Version v is the policy after v optimizer steps (or a loaded state). A
SamplingClient is pinned to the version it was made from; the engine (and, for LoRA, the model:
they share tensors, spirl/core/lora.py) holds one version at a time, `activate(v)` switches: the
current one from the masters, an older one from its snapshot (LoRA: a copy of the adapters;
full fine-tuning: the bf16 weights in host memory), taken only while a sampler of it is alive.

Parity. Samplers report the logprob of each sampled token under the model's own distribution
(no temperature; vLLM's raw_logprobs), which is what `forward_backward` computes. Every sampled
sequence is remembered with its version; a datum whose tokens came from a sampler at the current
version (found by its provenance spans, or by its whole token sequence) has each sampled token's
trainer logprob compared with the sampler's, bit for bit, in the same forward that trains on it:
`parity/tokens_compared:sum` and `parity/tokens_different:sum` in the metrics, and a mismatch raises
spirl.numerics.parity.ParityError with the report simple_rl.py writes. Off-policy data is trained as given.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.spec import EngineSpec, PolicySpec
from ..engines.base import Request
from ..numerics.samples import Sample
from ..numerics.parity import ParityError, check_parity, every_token_logprobs
from . import losses

log = logging.getLogger("spirl.tinker")

TRAIN_TARGETS = {"train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "train_mlp": ("gate_proj", "up_proj",
                                                                                        "down_proj"),
                 "train_unembed": ("lm_head",)}
"""Tinker's create_lora_training_client switches -> the LoRA targets they mean."""


@dataclass
class BackendConfig:
    """How the local backend runs; read from the environment by `from_env` (constructor arguments
    that only matter to the hosted service are ignored)."""

    engine: str = ""
    """SPIRL_ENGINE: `vllm` (GPU, VLLM_BATCH_INVARIANT=1) or `native` (plain PyTorch); empty = vllm with a
    GPU, native without."""
    root: str = "tinker_runs"
    """SPIRL_TINKER_DIR: where runs keep their checkpoints (tinker://<run>/weights/<name> is
    <root>/<run>/weights/<name>) and parity reports."""
    gpu_memory_utilization: float = EngineSpec.gpu_memory_utilization
    """SPIRL_GPU_MEMORY_UTILIZATION: vLLM's share of the GPU."""
    max_model_len: int = EngineSpec.max_model_len
    """SPIRL_MAX_MODEL_LEN: longest prompt + completion the engine accepts."""
    max_tokens_per_microbatch: int = 16384
    """SPIRL_MAX_TOKENS_PER_MICROBATCH: tokens per forward/backward pass (gradient accumulation)."""

    @classmethod
    def from_env(cls) -> "BackendConfig":
        env = os.environ.get
        engine = env("SPIRL_ENGINE", "") or ("vllm" if torch.cuda.is_available() else "native")
        if engine not in ("vllm", "native"):
            raise ValueError(f"SPIRL_ENGINE={engine!r}: use vllm or native")
        return cls(engine=engine, root=env("SPIRL_TINKER_DIR", cls.root),
                   gpu_memory_utilization=float(env("SPIRL_GPU_MEMORY_UTILIZATION", cls.gpu_memory_utilization)),
                   max_model_len=int(env("SPIRL_MAX_MODEL_LEN", cls.max_model_len)),
                   max_tokens_per_microbatch=int(env("SPIRL_MAX_TOKENS_PER_MICROBATCH", cls.max_tokens_per_microbatch)))


@dataclass
class Sampled:
    """One sampled sequence, remembered for the parity check of the data trained on it."""

    version: int
    prompt: list[int]
    tokens: list[int]
    logprobs: torch.Tensor


@dataclass
class _Seq:
    """A trainable sequence for spirl.numerics.parity.check_parity: the datum's tokens, its compared positions."""

    ids: list[int]
    loss_mask: list[bool]
    logprobs: torch.Tensor


@dataclass
class Session:
    """The backend of one process: one base model (one engine), at most one training policy."""

    cfg: BackendConfig
    base_model: str
    checkpoint: object
    """The base model's torchtitan_compat.config.ModelDir: its config read and checked once, by the client."""
    lora: object | None
    """spirl.core.spec.LoRAInit of the training policy, None for full fine-tuning."""
    seed: int
    policy: object = None
    engine: object = None
    device: torch.device = None
    version: int = 0
    engine_version: int = 0
    snapshots: dict = field(default_factory=dict)
    samplers: dict = field(default_factory=dict)
    """version -> WeakSet of live SamplingClients pinned to it."""
    sampled: dict = field(default_factory=dict)
    """sequence_id -> Sampled, for the current and the previous version."""
    by_tokens: dict = field(default_factory=dict)
    run_id: str = "run"
    fb_calls: int = 0
    policy_spec: object = None
    """The policy's spirl.core.spec.PolicySpec (sync_weights and adapter_writer take it)."""
    tokenizer: object = None
    trainer_attached: bool = False
    _ids: object = field(default_factory=lambda: itertools.count())
    _pool: cf.ThreadPoolExecutor = None
    _pending: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _sample_counter: int = 0

    # -- setup ------------------------------------------------------------------------------------------------

    def start(self) -> "Session":
        """Build policy and engine (on the worker thread, like everything that touches them)."""
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="spirl-tinker")
        self._pool.submit(self._build).result()
        return self

    def _build(self) -> None:
        from ..core.build import build_policy_and_engine
        from ..core.preflight import resolve_device

        self.device = resolve_device("auto" if self.cfg.engine == "vllm" else "cpu")
        engine = EngineSpec(kind=self.cfg.engine, logprobs="raw", seed=self.seed,
                            gpu_memory_utilization=self.cfg.gpu_memory_utilization, max_model_len=self.cfg.max_model_len)
        spec = PolicySpec(model=str(self.model_dir), engine=engine, lora=self.lora, seed=self.seed,
                          dtype="bfloat16" if self.cfg.engine == "vllm" else "float32")
        self.policy_spec = spec
        self.policy, self.engine = build_policy_and_engine(self.checkpoint, spec, self.device)
        if self.cfg.engine == "native":  # plain PyTorch on the CPU is not batch invariant: see NativeEngine
            self.engine.one_per_forward = True
        lora = getattr(self.lora, "spec", None)
        log.info("Tinker backend ready: %s on %s (%s, %s)", self.base_model, self.device, self.cfg.engine,
                 f"LoRA rank {lora.rank} on {','.join(lora.targets)}" if lora else "full fine-tuning")

    @property
    def model_dir(self) -> Path:
        return self.checkpoint.path

    @property
    def model(self):
        """The trainer's compute model (the policy's)."""
        return self.policy.model

    def submit(self, fn, *args) -> cf.Future:
        """Run fn(*args) on the worker thread, after everything submitted before it."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.submit(self._close).result()
            self._pool.shutdown(wait=True)
            self._pool = None

    def _close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            log.info("Tinker backend closed (engine closed)")

    # -- weights versions ---------------------------------------------------------------------------------------

    def pin(self, sampler, version: int) -> None:
        """Remember that `sampler` samples from `version` (so its snapshot is taken before it changes)."""
        self.samplers.setdefault(version, weakref.WeakSet()).add(sampler)

    def _live(self, version: int) -> bool:
        return bool(self.samplers.get(version))

    def _snapshot(self):
        """The current weights, to restore later: adapters (LoRA) or the bf16 weights in host memory."""
        if self.lora is not None:
            return {n: p.detach().clone() for n, p in self.policy.masters.items()}
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def _before_update(self) -> None:
        """Called before the weights change: keep a snapshot of the current version if a sampler
        still samples from it; forget snapshots nobody samples from."""
        if self._live(self.version) and self.version not in self.snapshots:
            self.snapshots[self.version] = self._snapshot()
        for v in [v for v in self.snapshots if not self._live(v)]:
            del self.snapshots[v]

    @torch.no_grad()
    def activate(self, version: int) -> None:
        """Make the engine (and the trainer's model) compute with weights `version`."""
        if version == self.engine_version:
            return
        from ..core.policy import sync_weights

        if version == self.version:
            self.policy.push_masters_to_model()
        elif version in self.snapshots:
            snap = self.snapshots[version]
            if self.lora is not None:
                for path, m in self.policy.modules.items():
                    m.merge({t: (snap[f"{path}.lora_A.{t}"], snap[f"{path}.lora_B.{t}"]) for t, _, _ in m.blocks})
            else:
                for n, p in self.model.named_parameters():
                    p.copy_(snap[n])
        else:
            raise ValueError(f"the weights of version {version} are gone (no sampler kept them)")
        sync_weights(self.engine, self.policy, self.policy_spec)
        self.engine_version = version

    def new_version(self) -> None:
        """The masters changed (an optimizer step, a loaded state): the model holds the new version."""
        self.version += 1
        self.engine_version = self.version
        self.sampled = {k: s for k, s in self.sampled.items() if s.version >= self.version - 1}
        self.by_tokens = {k: s for k, s in self.by_tokens.items() if s.version >= self.version - 1}

    # -- sampling -----------------------------------------------------------------------------------------------

    def request_sample(self, version: int, request: Request, future: cf.Future, prompt_logprobs: bool) -> None:
        """Queue a sampling request; queued requests run together (one engine call per version)."""
        with self._lock:
            self._pending.append((version, request, future, prompt_logprobs))
        self.submit(self._flush)

    def next_seed(self, n: int = 1) -> int:
        """The seed of a request of `n` samples that names none. vLLM seeds its samples s, s+1, ..., s+n-1
        (VLLMEngine.seeds_children), so the next request's seed comes after them: no two samples of a session
        share a random stream (shared seeds draw the same noise for different prompts). One-sample requests
        get consecutive seeds, which `_sample` merges into one request of n."""
        with self._lock:
            first = self._sample_counter + 1
            self._sample_counter += n
            return (self.seed * 1_000_003 + first) % (2**31)

    def _flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
        # a burst of concurrent requests (the cookbook sends one per environment) arrives over a few
        # milliseconds: wait until it stops growing (at most 0.1 s), then run it as one engine call
        for _ in range(33):
            seen = len(self._pending)
            time.sleep(0.003)
            if len(self._pending) == seen:
                break
        with self._lock:
            pending, self._pending = self._pending, []
        by_version: dict[int, list] = {}
        for item in pending:
            by_version.setdefault(item[0], []).append(item)
        for version, items in by_version.items():
            try:
                self.activate(version)
                groups = self._sample([req for _, req, _, _ in items])
                prompt_lps = self.prompt_logprobs([req.prompt for _, req, _, want in items if want])
                for (_, req, fut, want), group in zip(items, groups):
                    fut.set_result((self._remember(version, group), prompt_lps.pop(0) if want else None))
            except BaseException as e:  # noqa: BLE001 - every waiting caller gets the error
                for _, _, fut, _ in items:
                    if not fut.done():
                        fut.set_exception(e)

    def _sample(self, requests: list[Request]) -> list[list[Sample]]:
        """Each request's samples, from one engine call. On an engine that seeds the samples of a
        request of n as n requests of consecutive seeds (VLLMEngine.seeds_children), runs of
        requests of one prompt and settings whose seeds continue each other (the cookbook sends a
        group's envs one request each, and `next_seed` counts up) go as one request of n: the same
        bits, one request's overhead in the engine instead of n."""
        if not getattr(self.engine, "seeds_children", False):
            return self.engine.sample(requests)
        merged: list[tuple[Request, list[int]]] = []  # (engine request, n of each request it carries)
        for r in requests:
            if merged and r.seed is not None:
                last, parts = merged[-1]
                if (last.seed is not None and last.seed + last.n == r.seed
                        and dataclasses.replace(last, n=r.n, seed=r.seed) == r):
                    merged[-1] = (dataclasses.replace(last, n=last.n + r.n), parts + [r.n])
                    continue
            merged.append((r, [r.n]))
        out = []
        for (_, parts), samples in zip(merged, self.engine.sample([m for m, _ in merged]), strict=True):
            start = 0
            for n in parts:
                out.append(samples[start:start + n])
                start += n
        return out

    def _remember(self, version: int, group: list[Sample]) -> list[tuple[str, Sample]]:
        out = []
        for s in group:
            seq_id = f"{self.run_id}-v{version}-{next(self._ids)}"
            rec = Sampled(version, list(s.prompt_ids), list(s.completion_ids), s.logprobs.float().cpu())
            self.sampled[seq_id] = rec
            self.by_tokens[tuple(rec.prompt + rec.tokens)] = rec
            out.append((seq_id, s))
        return out

    @torch.no_grad()
    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float | None]]:
        """[None, log p(t1 | t0), ...] of each prompt at the active weights: the trainer's own forward
        (spirl.numerics.parity.sampled_logprobs), i.e. forward_backward's bits."""
        if not prompts:
            return []
        lps = every_token_logprobs(self.model, prompts, self.device,
                                   one_per_forward=getattr(self.engine, "one_per_forward", False))
        return [[None] + lp.float().cpu().tolist() for lp in lps]

    # -- training -----------------------------------------------------------------------------------------------

    def forward_backward(self, data, loss_fn, config, backward: bool, custom=None):
        """(per-datum target logprobs [N] (float32, CPU), loss sum, custom metrics, (tokens compared,
        different)). With `backward` the loss's gradients are added to the masters' .grad, micro-batch
        by micro-batch, each after its parity check (a ParityError leaves no gradient of this call)."""
        self.activate(self.version)
        seqs, inputs = [], []
        for i, d in enumerate(data):
            tokens, targets, fields = datum_arrays(d, i, needed=() if custom else losses.INPUTS[loss_fn])
            seqs.append(Sample(tokens[:1], tokens[1:] + [int(targets[-1])], torch.empty(0)))
            inputs.append((targets, fields))
        # micro-batches of whole datums (one each on the native engine: see NativeEngine.one_per_forward).
        # A custom callable sees every datum at once: its micro-batches' logprobs (and their graphs) are
        # gathered and it runs once, then one backward. A per-datum loss (a LossHandle) runs per micro-batch.
        whole = custom is not None and not getattr(custom, "per_datum", False)
        budget = 0 if getattr(self.engine, "one_per_forward", False) else self.cfg.max_tokens_per_microbatch
        batches, start = [], 0
        while start < len(seqs):
            end, used = start, 0
            while end < len(seqs) and (end == start or used + len(seqs[end].ids) <= budget):
                used += len(seqs[end].ids)
                end += 1
            batches.append(slice(start, end))
            start = end
        out_lps, total, metrics, compared, different, gathered = [], 0.0, None, 0, 0, []
        self.fb_calls += 1

        def apply(value) -> float:
            if backward:
                value.backward()
                self.policy.grads_to_masters()
            return float(value.detach().sum())
        try:
            with torch.set_grad_enabled(backward):
                for sl in batches:
                    lp, sizes = self._logprobs(seqs[sl], inputs[sl])
                    on_host = list(lp.detach().float().cpu().split(sizes))
                    c, d = self.check_parity(data[sl], seqs[sl], on_host)
                    compared, different = compared + c, different + d
                    out_lps += on_host
                    if whole:
                        gathered += list(lp.split(sizes))
                    elif custom is not None:
                        value, metrics = custom(data[sl], list(lp.split(sizes)))
                        total += apply(value)
                    else:  # every loss is a sum over tokens: one call over the micro-batch's tokens
                        keys = losses.INPUTS[loss_fn]
                        total += apply(losses.loss(loss_fn, lp, {k: torch.cat([f[k] for _, f in inputs[sl]]).to(
                            lp.device) for k in keys}, config))
                if whole:
                    value, metrics = custom(data, gathered)
                    total += apply(value)
        except ParityError:
            self.policy.optimizer.zero_grad(set_to_none=True)  # nothing of a step that failed parity is applied
            raise
        self._log_parity(len(data), compared, different, backward)
        return out_lps, total, metrics, (compared, different)

    def _log_parity(self, datums: int, compared: int, different: int, backward: bool) -> None:
        """One line per forward(_backward) in <root>/<run>/parity.jsonl (flushed: nothing is lost)."""
        path = Path(self.cfg.root) / self.run_id / "parity.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"call": self.fb_calls, "version": self.version, "datums": datums,
                                "backward": backward, "tokens_compared": compared, "tokens_different": different})
                    + "\n")

    def _logprobs(self, seqs, inputs) -> tuple[torch.Tensor, list[int]]:
        """The trainer's logprob of every target of the datums ([sum of N], float32), one packed
        forward, and each datum's N."""
        from ..numerics.parity import pack_sampled

        packed, rows, _, sizes = pack_sampled(seqs, self.device)
        targets = torch.cat([t for t, _ in inputs]).to(self.device)
        lps, _ = self.model.token_logprobs(packed.tokens, packed.positions, packed.cu_seqlens, packed.max_seqlen,
                                           rows, targets)
        return lps, sizes

    def check_parity(self, data, seqs: list[Sample], target_lps: list[torch.Tensor]) -> tuple[int, int]:
        """Compare every sampled token of on-policy data (see the module docstring); ParityError on a
        difference. Returns (tokens compared, tokens different)."""
        checked, trainer = [], []
        for d, s, lp in zip(data, seqs, target_lps):
            ids = s.ids  # the datum's model_input and its last target
            positions, sampler = self._on_policy_positions(d, ids)
            if not positions:
                continue
            mask = [False] * len(ids)
            for p in positions:
                mask[p + 1] = True
            checked.append(_Seq(ids, mask, torch.tensor(sampler, dtype=torch.float32)))
            trainer.append(lp[positions])
        if not checked:
            return 0, 0
        run_dir = Path(self.cfg.root) / self.run_id
        report = check_parity(checked, trainer, self.fb_calls, run_dir, self.engine, self.policy)
        return report.tokens_compared, report.tokens_different

    def _on_policy_positions(self, d, ids: list[int]) -> tuple[list[int], list[float]]:
        """(loss positions holding tokens a sampler at the current version drew, their sampler
        logprobs), from the datum's provenance spans, else from its whole token sequence."""
        spans = d.loss_fn_input_spans
        targets = d.loss_fn_inputs["target_tokens"].data
        positions, lps = [], []
        if spans:
            cursor = 0
            for span in spans:
                rec = self.sampled.get(getattr(span, "sequence_id", None))
                if type(span).__name__ == "SampledProvenanceSpan" and rec is not None and rec.version == self.version:
                    toks = rec.tokens[span.offset:span.offset + span.length]
                    if list(targets[cursor:cursor + span.length]) == toks:
                        positions += range(cursor, cursor + span.length)
                        lps += rec.logprobs[span.offset:span.offset + span.length].tolist()
                cursor += span.length
            return positions, lps
        rec = self.by_tokens.get(tuple(ids))
        if rec is None or rec.version != self.version:
            return [], []
        first = len(rec.prompt) - 1
        return list(range(first, first + len(rec.tokens))), rec.logprobs.tolist()

    def optim_step(self, adam) -> dict:
        from ..core.optim import clip_grad_norm

        self._before_update()
        params = list(self.policy.masters.values())
        metrics = {}
        if adam.grad_clip_norm > 0:
            metrics["optim/grad_norm:mean"] = float(clip_grad_norm(params, adam.grad_clip_norm))
        for g in self.policy.optimizer.param_groups:
            g.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                     weight_decay=adam.weight_decay)
        self.policy.optimizer.step()
        self.policy.optimizer.zero_grad(set_to_none=True)
        self.policy.push_masters_to_model()
        from ..core.policy import sync_weights

        sync_weights(self.engine, self.policy, self.policy_spec)
        self.new_version()
        return metrics


def datum_arrays(d, index: int, needed=()) -> tuple[list[int], torch.Tensor, dict[str, torch.Tensor]]:
    """(model_input tokens, target_tokens [N] int64, {loss input name: float32 [N]}) of a Datum,
    checked: text chunks only, 1-D inputs of the model_input's length."""
    try:
        tokens = d.model_input.to_ints()
    except ValueError:
        raise ValueError(f"datum {index}: only token (EncodedTextChunk) model inputs are supported") from None
    fields = dict(d.loss_fn_inputs)
    if "target_tokens" not in fields:
        raise ValueError(f"datum {index}: loss_fn_inputs has no target_tokens")
    missing = [k for k in needed if k not in fields]
    if missing:
        raise ValueError(f"datum {index}: loss_fn_inputs lacks {', '.join(missing)}")
    out = {}
    for k, v in fields.items():
        t = v.to_torch() if hasattr(v, "to_torch") else torch.as_tensor(v)
        if t.dim() != 1 or t.shape[0] != len(tokens):
            raise ValueError(f"datum {index}: loss_fn_inputs[{k!r}] has shape {list(t.shape)}; SPIRL's backend takes "
                             f"1-D inputs of the model_input's length {len(tokens)}")
        out[k] = t
    if not tokens:
        raise ValueError(f"datum {index}: empty model_input")
    targets = out.pop("target_tokens").long()
    return tokens, targets, {k: v.float() for k, v in out.items() if k in needed}
