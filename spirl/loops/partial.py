"""Partial rollouts (--partial-rollout-tokens C): long completions carried to the next step instead of blocking it.

A step's engine call samples at most C new tokens per completion: the new prompts' groups, and the continuation of
every completion carried from earlier steps (its prompt plus what it has so far as the prompt, at most C more
tokens, never past --max-new-tokens in all). A completion has ended when its engine stopped it (EOS) or it holds
--max-new-tokens tokens; a group (one prompt's --group-size completions) is trained on in the step its last
completion ends, and until then it is carried. Every segment is checked bit for bit in the step that samples it,
against the trainer holding the weights that sampled it (a segment's prompt is the whole prefix), so a carried
completion's behaviour logprobs are exact token by token, each for the policy that sampled it: the ratio a token
sampled k updates earlier shows is real off-policyness.

Nothing depends on timing: a step samples its new prompts with its seeds (as without partial rollouts) and a
continuation with a seed of its group (the step that drew its prompt and its place there), its member and its
segment, never of the rank; every rank continues a contiguous share of the carried groups and the groups that end
are gathered in the order their prompts were drawn. So a run repeats bit for bit and, with the carried groups in
its checkpoints (partial.json, partial.safetensors), resumes on any number of ranks; with C >= --max-new-tokens
nothing is carried and the run is the one without partial rollouts. A step in which no group ends takes no update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.distributed import World, even_slices
from ..core.multiturn import prompt_seeds
from ..engines.base import Request
from ..numerics.samples import Sample
from . import ahead
from .prompts import round_seed, step_seed

PARTIAL_JSON = "partial.json"
PARTIAL_TENSORS = "partial.safetensors"


@dataclass
class Carried:
    """A group whose completions have not all ended: each member's completion so far (its prompt the original one,
    its logprobs the segments' behaviour logprobs), where its prompt was drawn, and how many segments it has."""

    origin: tuple[int, int]
    """(the step that drew its prompt, the prompt's index among that step's prompts): its order and seeds."""
    samples: list[Sample]
    metas: list
    segments: int = 1


def ended(s: Sample, max_new_tokens: int) -> bool:
    """A completion has ended: the engine stopped it (EOS, a stop token) or it holds --max-new-tokens tokens."""
    return s.finish_reason != "length" or len(s.completion_ids) >= max_new_tokens


def extend(so_far: Sample, segment: Sample) -> Sample:
    """A completion with one more segment: the segment's tokens and logprobs appended (its prompt was the whole
    prefix), its finish reason, and its routes (the segment forwarded every token but its last)."""
    return Sample(so_far.prompt_ids, so_far.completion_ids + segment.completion_ids,
                  torch.cat([so_far.logprobs, segment.logprobs]), segment.finish_reason, segment.routes)


def continuation_seed(seed: int, origin: tuple[int, int], member: int, segment: int, group_size: int) -> int:
    """The sampling seed of a carried completion's next segment: of its group, member and segment only."""
    return step_seed(round_seed(seed, origin[0], 0), (origin[1] * group_size + member) * 4096 + segment) % (2**31)


@dataclass
class PartialRound:
    """What one step sampled, on this rank: new groups (each prompt's samples) and the carried groups it continued
    (updated), the segments sampled (what parity checks), and which groups ended."""

    segments: list[Sample]
    groups: list[Carried]
    """This rank's groups after the step's segments: the continued ones, then the new ones."""
    ended: list[bool] = field(default_factory=list)


def requests(cfg, step: int, first: int, prompts: list, share: list[Carried]) -> tuple[list[Request], list]:
    """The engine requests of a step on this rank: the new prompts' groups (seeds as without partial rollouts), then
    one request per unfinished member of the carried `share`; and for each continuation its (group, member)."""
    budget = min(cfg.partial_rollout_tokens, cfg.max_new_tokens)
    sampling = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
    seeds = prompt_seeds(round_seed(cfg.seed, step, 0), first, len(prompts), cfg.group_size)
    out = [Request(list(p), n=cfg.group_size, max_tokens=budget, seed=s, **sampling) for (p, _), s in zip(prompts, seeds)]
    where = []
    for g in share:
        for m, s in enumerate(g.samples):
            if not ended(s, cfg.max_new_tokens):
                left = cfg.max_new_tokens - len(s.completion_ids)
                seed = continuation_seed(cfg.seed, g.origin, m, g.segments, cfg.group_size)
                out.append(Request(s.ids, n=1, max_tokens=min(cfg.partial_rollout_tokens, left), seed=seed, **sampling))
                where.append((g, m))
    return out, where


def sample_partial(engine, cfg, step: int, first: int, prompts: list, share: list[Carried]) -> PartialRound:
    """One engine call for the step's new prompts and the carried share's continuations (module docstring)."""
    reqs, where = requests(cfg, step, first, prompts, share)
    outs = engine.sample(reqs)
    new, continued = outs[:len(prompts)], outs[len(prompts):]
    segments = [s for group in outs for s in group]
    groups = [Carried(g.origin, list(g.samples), g.metas, g.segments + 1) for g in share]
    index = {id(g): i for i, g in enumerate(share)}
    for (g, m), (segment,) in zip(where, continued):
        groups[index[id(g)]].samples[m] = extend(g.samples[m], segment)
    for i, (samples, (_, meta)) in enumerate(zip(new, prompts)):
        groups.append(Carried((step, first + i), list(samples), [meta] * cfg.group_size))
    return PartialRound(segments, groups, [all(ended(s, cfg.max_new_tokens) for s in g.samples) for g in groups])


class PartialState:
    """The carried groups of every rank, in the order their prompts were drawn (the same list on every rank)."""

    def __init__(self, carried: list[Carried] | None = None):
        self.carried = list(carried or [])
        self.settled = None
        """The round `carried` was last taken from (spirl.loops.rollout.carry_open), None before any."""

    def share(self, world: World) -> list[Carried]:
        """This rank's contiguous share of the carried groups to continue this step."""
        return self.carried[even_slices(len(self.carried), world.size)[world.rank]]

    def scalars(self, trained: list[Carried]) -> dict:
        n = len(trained)
        return {"partial/groups_trained": float(n), "partial/groups_carried": float(len(self.carried)),
                "partial/segments_mean": sum(g.segments for g in trained) / n if n else 0.0,
                "partial/segments_max": float(max((g.segments for g in trained), default=0))}

    def write(self, directory: Path) -> None:
        """partial.json (ids, metas, where each group was drawn) and partial.safetensors (logprobs, routes)."""
        tensors: dict[str, torch.Tensor] = {}
        doc, i = {"groups": []}, 0
        for g in self.carried:
            members = []
            for s in g.samples:
                members.append(ahead.encode_sequence(s, tensors, i))
                i += 1
            doc["groups"].append({"origin": list(g.origin), "segments": g.segments, "metas": g.metas,
                                  "samples": members})
        ahead.write_doc(directory, (PARTIAL_JSON, PARTIAL_TENSORS), doc, tensors)

    @classmethod
    def read(cls, directory: Path) -> "PartialState":
        doc, tensors = ahead.read_doc(directory, (PARTIAL_JSON, PARTIAL_TENSORS))
        carried, i = [], 0
        for g in doc["groups"]:
            samples = []
            for d in g["samples"]:
                samples.append(ahead.decode_sequence(d, tensors, i))
                i += 1
            carried.append(Carried(tuple(g["origin"]), samples, g["metas"], g["segments"]))
        return cls(carried)
