"""Trainer-side logprobs of sampled tokens, and the bitwise comparison with the engine's.

The trainer recomputes every trainable sequence (a single-turn Sample or a multi-turn
Trajectory: `ids`, `loss_mask`, `logprobs`, see spirl.numerics.samples) in one packed forward and
takes the logprob of each sampled token (loss_mask True) from the row that predicts it: token i
of a sequence is predicted by row i - 1 of that sequence.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from torchtitan_compat import PackedTokens, pack
from torchtitan_compat.config import is_moe, sparse_layers
from torchtitan_compat.model import LayerRecord
from torchtitan_compat.packing import flatten

from .samples import Sample

log = logging.getLogger("spirl.numerics.parity")


class ParityError(RuntimeError):
    """The engine's and the trainer's logprob of some sampled token differ."""


def pack_sampled(seqs: list[Sample], device=None) -> tuple[PackedTokens, torch.Tensor, torch.Tensor, list[int]]:
    """The packed batch and, from each sequence's `loss_mask`: the rows of that batch that predict
    sampled tokens, those tokens, and how many each sequence has; on `device` if given (else CPU).

    Works from the mask, so a prompt + completion and a multi-turn trajectory (sampled turns
    between environment replies) are handled alike. Vectorized: the trainer does this on the host
    before every forward while the GPU waits (~0.5 us a token as per-token Python)."""
    ids, masks = [s.ids for s in seqs], [s.loss_mask for s in seqs]
    for i, (x, m) in enumerate(zip(ids, masks)):
        if len(m) != len(x):
            raise ValueError(f"sequence {i}: loss_mask has {len(m)} entries for {len(x)} tokens")
    packed = pack(ids)
    mask = flatten(masks, np.bool_, len(packed.tokens))
    cu = packed.cu_seqlens.long()
    first = mask[cu[:-1]]
    if first.any():
        raise ValueError(f"sequence {int(first.nonzero()[0])}: its first token is marked sampled, "
                         "but nothing predicts it")
    picked = mask.nonzero().squeeze(1)  # token j of the batch is predicted by row j - 1
    counts = torch.cat([torch.zeros(1, dtype=torch.long), mask.cumsum(0)])
    rows, targets = picked - 1, packed.tokens[picked]
    if device is not None:
        packed, rows, targets = packed.to(device), rows.to(device), targets.to(device)
    return packed, rows, targets, (counts[cu[1:]] - counts[cu[:-1]]).tolist()


@dataclass(frozen=True)
class SamplingDist:
    """Which distribution's logprobs: the sampler's (`--logprobs sampling`: logits / temperature,
    then min-p, exactly as vLLM's V2 sampler and its `processed_logprobs`) or the raw logits'
    (`--logprobs raw`: the default-constructed RAW)."""

    temperature: float = 1.0
    min_p: float = 0.0


RAW = SamplingDist()


def logprob_dist(mode: str, temperature: float, min_p: float = 0.0) -> SamplingDist:
    """The distribution a `--logprobs` mode (`sampling` or `raw`) names, for samples drawn with
    these settings."""
    return SamplingDist(temperature, min_p) if mode == "sampling" else RAW


def _logprobs(model, seqs, device, dist: SamplingDist, entropy: bool, routes: list | None = None,
              router: tuple[dict, dict] | None = None):
    """One packed forward over every sequence; the logprob (and entropy) of each sampled token. `routes`: a list
    that gets each sequence's expert ids (Qwen3-MoE; `_routes_of`); `router`: two dicts that get each sparse
    layer's router logits and expert ids over the packed batch."""
    packed, rows, targets, sizes = pack_sampled(seqs, device)
    layers = LayerRecord() if routes is not None else (router[1] if router is not None else None)
    lps, ent = model.token_logprobs(packed.tokens, packed.positions, packed.cu_seqlens, packed.max_seqlen,
                                    rows, targets, dist.temperature, dist.min_p,
                                    entropy=entropy, routes=layers, router_logits=router and router[0])
    if layers and routes is not None:
        routes.extend(_routes_of(layers, packed.cu_seqlens, model.args.n_layers))
    return list(lps.split(sizes)), (list(ent.split(sizes)) if entropy else None)


def _routes_of(layers: dict, cu_seqlens: torch.Tensor, n_layers: int) -> list[torch.Tensor]:
    """Per sequence, uint8 [len - 1, n_layers, k] expert ids of its tokens but the last (vLLM's routed_experts
    form: dense layers' rows 0) from each sparse layer's int32 [T, k] ids of the packed batch."""
    first = next(iter(layers.values()))
    full = torch.zeros((first.shape[0], n_layers, first.shape[1]), dtype=torch.uint8, device=first.device)
    for i, ids in layers.items():
        full[:, i] = ids.to(torch.uint8)
    full = full.cpu()
    bounds = cu_seqlens.tolist()
    return [full[a:b - 1] for a, b in zip(bounds[:-1], bounds[1:])]


def sampled_logprobs_and_routes(model, seqs: list[Sample], device, dist: SamplingDist = RAW):
    """`sampled_logprobs` (the same forward, so the same bits) and, for Qwen3-MoE, each sequence's expert ids in
    the engine's form (`Sample.routes`); None for a dense model."""
    routes = [] if is_moe(model.args) else None
    lps = _logprobs(model, seqs, device, dist, entropy=False, routes=routes)[0]
    return lps, routes


def sampled_logprobs(model, seqs: list[Sample], device, dist: SamplingDist = RAW) -> list[torch.Tensor]:
    """The trainer's float32 logprob of every sampled token under `dist`, one tensor per
    sequence. Differentiable when grad is enabled."""
    return _logprobs(model, seqs, device, dist, entropy=False)[0]


@dataclass
class ParityReport:
    tokens_compared: int
    tokens_different: int
    max_abs_diff: float
    first_mismatch: tuple[int, int] | None = None
    """(sequence index, index among its sampled tokens) of the first differing token, if any."""
    per_sample_different: list[int] = field(default_factory=list)
    routes: "RouteReport | None" = None
    """Qwen3-MoE: the trainer's expert ids against the engine's (None: a dense model, or no routes returned)."""

    @property
    def bitwise_identical(self) -> bool:
        routes_equal = self.routes is None or self.routes.different == 0
        return self.tokens_compared > 0 and self.tokens_different == 0 and routes_equal

    def summary(self) -> str:
        head = (f"tokens compared: {self.tokens_compared}, different: {self.tokens_different}, "
                f"max |Δ|: {self.max_abs_diff:.3e}")
        if self.routes is not None:
            head += f", {self.routes.summary()}"
        if self.tokens_compared == 0:
            return head + " - NOTHING COMPARED"
        if self.bitwise_identical:
            return head + " - EXACT BITWISE MATCH"
        if self.first_mismatch is None:
            return head + f" - first route difference: {self.routes.where()}"
        s, j = self.first_mismatch
        return head + f" - first mismatch: sequence {s}, sampled token {j}"


@dataclass
class RouteReport:
    """The trainer's expert choices against the engine's, per (token, sparse layer)."""

    compared: int
    """(token, sparse layer) pairs compared."""
    different: int
    """Pairs whose ids differ in any slot (slots come in descending routing weight)."""
    flips: int
    """Pairs whose set of experts differs: the token went through other experts (a router flip)."""
    first: tuple[int, int, int] | None = None
    """(sequence, token, layer) of the first differing pair."""
    first_ids: tuple[list[int], list[int]] | None = None
    """(engine's, trainer's) expert ids there."""
    load: torch.Tensor | None = None
    """int64 [sparse layers, experts]: how many (token, slot) pairs each expert took, by the trainer's routes."""

    def merged(self, other: "RouteReport") -> "RouteReport":
        """The two reports as one (a step's rounds)."""
        first, ids = (self.first, self.first_ids) if self.first is not None else (other.first, other.first_ids)
        load = self.load if other.load is None else (other.load if self.load is None else self.load + other.load)
        return RouteReport(self.compared + other.compared, self.different + other.different,
                           self.flips + other.flips, first, ids, load)

    def summary(self) -> str:
        return f"routes compared: {self.compared} (token x layer), router flips: {self.flips}, other order: " \
               f"{self.different - self.flips}"

    def where(self) -> str:
        s, t, layer = self.first
        engine, trainer = self.first_ids
        return f"sequence {s}, token {t}, layer {layer}: engine experts {engine}, trainer {trainer}"


def expert_load_scalars(load: torch.Tensor | None, sparse: tuple[int, ...]) -> dict[str, float]:
    """moe/layer{i}/load_max_over_mean per sparse layer of a RouteReport's `load` (1.0: perfectly balanced) and
    their maximum."""
    if load is None or not load.numel():
        return {}
    ratio = (load.max(-1).values / load.float().mean(-1).clamp_min(1e-9)).tolist()
    out = {f"moe/layer{i}/load_max_over_mean": r for i, r in zip(sparse, ratio)}
    out["moe/load_max_over_mean"] = max(ratio)
    return out


def routes_report(samples: list, trainer_routes: list | None, model_args) -> RouteReport | None:
    """The samples' engine routes against the trainer's of the same forward (None: a dense model, or none given)."""
    if trainer_routes is None or not is_moe(model_args):
        return None
    return compare_routes([getattr(s, "routes", None) for s in samples], trainer_routes, sparse_layers(model_args),
                          model_args.moe_args.num_experts)


def compare_routes(engine_routes: list, trainer_routes: list, sparse: tuple[int, ...],
                   experts: int) -> RouteReport | None:
    """Per sequence, uint8 [rows, layers, k] expert ids (the engine's and the trainer's) on the sparse layers.
    None when the engine returned none."""
    if not sparse or any(r is None for r in engine_routes):
        return None
    compared = different = flips = 0
    first = first_ids = None
    load = torch.zeros((len(sparse), experts), dtype=torch.long)
    for i, (a, b) in enumerate(zip(engine_routes, trainer_routes)):
        a, b = torch.as_tensor(a)[:, list(sparse)].long(), b[:, list(sparse)].long()
        if a.shape != b.shape:
            raise ValueError(f"sequence {i}: engine routes {list(a.shape)} vs trainer routes {list(b.shape)}")
        load += torch.stack([torch.bincount(b[:, j].reshape(-1), minlength=experts) for j in range(len(sparse))])
        slot = (a != b).any(-1)
        flip = (a.sort(-1).values != b.sort(-1).values).any(-1)
        compared, different, flips = compared + slot.numel(), different + int(slot.sum()), flips + int(flip.sum())
        if first is None and slot.any():
            t, j = slot.nonzero()[0].tolist()
            first, first_ids = (i, t, sparse[j]), (a[t, j].tolist(), b[t, j].tolist())
    return RouteReport(compared, different, flips, first, first_ids, load)


def compare_logprobs(engine_lps: list[torch.Tensor], trainer_lps: list[torch.Tensor]) -> ParityReport:
    """Bitwise comparison (torch.equal semantics per token: same float32 value) of two lists."""
    if len(engine_lps) != len(trainer_lps):
        raise ValueError(f"{len(engine_lps)} engine sequences vs {len(trainer_lps)} trainer sequences")
    compared = different = 0
    max_diff, first, per_sample = 0.0, None, []
    for i, (a, b) in enumerate(zip(engine_lps, trainer_lps)):
        a, b = a.detach().float().cpu(), b.detach().float().cpu()
        if a.shape != b.shape:
            raise ValueError(f"sample {i}: {a.numel()} engine logprobs vs {b.numel()} trainer logprobs")
        differs = a.view(torch.int32) != b.view(torch.int32)  # bit patterns, so -0.0 != 0.0 too
        n = int(differs.sum())
        compared += a.numel()
        different += n
        per_sample.append(n)
        if a.numel():
            max_diff = max(max_diff, float((a - b).abs().max()))
        if n and first is None:
            first = (i, int(differs.nonzero()[0]))
    return ParityReport(compared, different, max_diff, first, per_sample)


def every_token_logprobs(model, id_lists: list[list[int]], device, dist: SamplingDist = RAW,
                         one_per_forward: bool = False) -> list[torch.Tensor]:
    """The trainer's float32 logprob of every token but the first of each sequence: all of them in
    one packed forward, or (`one_per_forward`) each sequence in a forward of its own (on a backend
    that is not batch invariant, the way to get the bits a one-sequence forward gives)."""
    seqs = [Sample(ids[:1], ids[1:], torch.empty(0)) for ids in id_lists]
    if one_per_forward:
        return [sampled_logprobs(model, [s], device, dist)[0] for s in seqs]
    return sampled_logprobs(model, seqs, device, dist)


def sampled_logprobs_and_entropy(model, seqs: list[Sample], device, dist: SamplingDist = RAW,
                                 entropy_grad: bool = False, router: tuple[dict, dict] | None = None
                                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`sampled_logprobs` (the same ops, so the same bits) plus the float32 entropy of `dist` at
    each sampled token's row. The entropy is detached unless `entropy_grad` (an entropy bonus
    needs its gradient; a metric does not). `router` (Qwen3-MoE): two dicts that get each sparse layer's router
    logits (with their gradient) and expert ids."""
    lps, ent = _logprobs(model, seqs, device, dist, entropy=True, router=router)
    return lps, ent if entropy_grad else [e.detach() for e in ent]


def check_parity(samples: list[Sample], trainer_lps, step: int, run_dir: Path, engine, policy,
                 trainer_routes: list | None = None) -> ParityReport:
    """Every sampled token (every turn of a multi-turn trajectory): engine logprob == trainer's,
    bitwise; Qwen3-MoE (`trainer_routes`): every token's experts in every sparse layer the same as the engine's.
    Collective: each rank checks its own samples, and if any rank differs the step fails
    on every rank with one ParityError naming the ranks (each differing rank writes its report)."""
    report = compare_logprobs([s.logprobs for s in samples], trainer_lps)
    if trainer_routes is not None:
        report.routes = routes_report(samples, trainer_routes, policy.model.args)
    failure = None if report.bitwise_identical else _report_mismatch(report, samples, trainer_lps, step, run_dir,
                                                                    engine, policy)
    world = policy.world
    failures = [(r, f) for r, f in enumerate(world.gather(failure)) if f is not None]
    if failures:
        where = "; ".join(f"rank {r}: {f}" if world.sharded else f for r, f in failures)
        raise ParityError(f"step {step}: {where}")
    return report


def _report_mismatch(report: ParityReport, samples, trainer_lps, step: int, run_dir: Path, engine, policy) -> str:
    """Write this rank's parity report (first differing token, and on one GPU with vLLM the first
    differing layer/op); returns the one-line summary."""
    i, j = report.first_mismatch or (0, 0)
    s = samples[i]
    position = [k for k, m in enumerate(s.loss_mask) if m][j]
    detail = {"step": step, "summary": report.summary(), "sequence_index": i, "sampled_token_index": j,
              "token_position": position, "ids": s.ids, "loss_mask": s.loss_mask,
              "engine_logprobs": s.logprobs.tolist(), "trainer_logprobs": trainer_lps[i].float().cpu().tolist(),
              "per_sequence_different": report.per_sample_different}
    if report.routes is not None:
        detail["routes"] = {"summary": report.routes.summary(),
                            "first_difference": report.routes.where() if report.routes.first else None}
    if policy.world.sharded:
        detail["rank"] = policy.world.rank
        detail["localization"] = ("not run: it needs the whole model on one GPU; resume this run's last checkpoint "
                                  "without torchrun to localize")
    elif is_moe(policy.model.args):
        detail["localization"] = "not run: the layer/op localizer covers dense Qwen3 only"
    elif hasattr(engine, "llm"):  # vLLM: find the first layer/op that differs
        try:
            from types import SimpleNamespace

            from spirl.numerics.localize import localize_sample

            detail["localization"] = localize_sample(SimpleNamespace(engine=engine, model=policy.model),
                                                     s.ids[:position + 1])
        except Exception as e:  # the report must still be written
            detail["localization"] = f"localization failed: {type(e).__name__}: {e}"
    suffix = f"_rank{policy.world.rank}" if policy.world.sharded else ""
    path = run_dir / f"parity_failure_step{step:06d}{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(detail, indent=1) + "\n")
    log.error("PARITY BROKEN at step %d: %s; sequence %d (%d tokens, %d sampled), token position %d; report: %s",
              step, report.summary(), i, len(s.ids), len(s.logprobs), position, path)
    if "localization" in detail:
        log.error("%s", detail["localization"])
    return f"{report.summary()} (report: {path})"
