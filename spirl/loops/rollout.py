"""One step's rollout: prompts -> samples -> parity -> rewards, in rounds with --dynamic-sampling, and the
share of it each rank trains on.

Prompts come from the run's PromptSource (spirl/loops/prompts.py). Every rank draws the round's whole list and
samples its contiguous share (`shard_of`), with the seed one process uses.

A round: the engine samples group_size completions per prompt; the trainer recomputes the logprob of every
sampled token, which must equal the engine's bit for bit (ParityError otherwise: the step is not applied);
then the rewards. Without filters (--filter, --dynamic-sampling) the step is one round of --prompts-per-step prompts.

Filters (--filter, --dynamic-sampling: spirl/loops/filters.py): a group (one prompt's samples) is trained on
only when every filter keeps it (--dynamic-sampling is DAPO's, arXiv 2503.14476, section 3.2: a group whose
rewards are all equal has zero advantage and teaches nothing). Rounds of new prompts (--prompts-per-step, times
--oversample; round r > 0 samples with round_seed(seed, step, r)) are sampled until --prompts-per-step groups are
kept, in the order they were sampled (kept groups beyond that are unused), or until
--dynamic-sampling-max-rounds, after which the step trains on what is kept (a warning says so; none kept: no
update). Which groups are kept is decided over every rank's groups (gathered), and each rank then trains on a
contiguous share of the kept groups, so N ranks keep and train on exactly what one process does. Parity is
checked on every sampled token of every round, kept or dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..core.distributed import World, even_slices, shard_of
from ..core.multiturn import episode_metrics, prompt_seeds, run_episodes
from ..numerics.parity import ParityReport, check_parity, sampled_logprobs_and_routes
from ..tasks.dataset import DatasetError
from ..tasks.rewards import RewardError, Scored, score
from .filters import FilterError, Group, GroupFilter
from .partial import PartialRound, sample_partial
from .loss import grpo_advantages
from .prompts import round_seed
from .setup import Run
from .update import Placeholder, sampling_dist
from .timing import timed

log = logging.getLogger("spirl.loops.rollout")


# -- one round ------------------------------------------------------------------------------------------------


def sampling_settings(cfg) -> dict:
    """The engine's sampling settings besides the temperature."""
    return dict(min_p=cfg.min_p, top_k=cfg.top_k, top_p=cfg.top_p)


@dataclass
class Round:
    """This rank's share of one round: sequences (prompt-major, group_size per prompt), metas, rewards."""

    samples: list
    metas: list
    scored: Scored
    report: ParityReport
    extra: dict = field(default_factory=dict)
    partial: PartialRound | None = None
    """--partial-rollout-tokens: the round's groups (continued and new); `samples` are those of the ended ones."""


@dataclass
class Generated:
    """What the engine sampled for this rank's prompts of one round: sequences, metas, the outputs the rewards
    score, and episode scalars (multi-turn)."""

    samples: list
    metas: list
    outputs: list
    extra: dict
    partial: PartialRound | None = None


def generate_round(run: Run, step: int, r: int, prompts: list, carried: list | None = None) -> Generated:
    """The engine's part of round r of a step: this rank's `prompts` sampled with the round's seeds (no parity,
    no rewards); with --partial-rollout-tokens also the continuations of `carried` (this rank's share of the
    carried groups, spirl.loops.partial). It reads only the engine, so it can run beside the trainer's forward and
    backward (spirl.loops.ahead)."""
    cfg, task, engine, world = run.cfg, run.task, run.engine, run.world
    seed, first = round_seed(cfg.seed, step, r), world.rank * len(prompts)  # shard_of's equal contiguous shares
    if cfg.partial_rollout_tokens:
        pr = sample_partial(engine, cfg, step, first, prompts, carried if carried is not None else [])
        return Generated(pr.segments, [], [], {}, pr)
    if getattr(task, "multi_turn", False):
        samples, metas = run_episodes(engine, task, prompts, cfg.group_size, cfg.max_turns, cfg.max_new_tokens,
                                      cfg.temperature, seed, max_len=cfg.max_model_len, first=first,
                                      **sampling_settings(cfg))
        return Generated(samples, metas, samples, episode_metrics(samples))
    seeds = prompt_seeds(seed, first, len(prompts), cfg.group_size)
    samples = engine.generate([p for p, _ in prompts], n=cfg.group_size, max_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, seed=seeds, **sampling_settings(cfg))
    metas = [meta for _, meta in prompts for _ in range(cfg.group_size)]
    return Generated(samples, metas, [s.completion_ids for s in samples], {})


def sample_round(run: Run, step: int, r: int, prompts: list, times: dict, generated=None, carried=None) -> Round:
    """Sample this rank's `prompts` (round r of the step), check parity on every sampled token, score them.
    `generated`: the round's samples when they were started earlier (a spirl.loops.ahead.Background whose
    result() is the Generated). Collective on several ranks (parity and a failing reward fail every rank)."""
    cfg, task, engine, policy = run.cfg, run.task, run.engine, run.policy
    world = policy.world
    if generated is None:
        with timed(times, "rollout"):
            gen = generate_round(run, step, r, prompts, carried)
    else:
        with timed(times, "rollout_wait"):  # the part of the background sampling the trainer waits for
            gen = generated.result()
    with timed(times, "parity"), torch.no_grad():  # every token sampled this round (partial: each new segment)
        trainer_lps, routes = sampled_logprobs_and_routes(policy.model, gen.samples, run.device, sampling_dist(cfg))
        report = check_parity(gen.samples, trainer_lps, step, run.run_dir, engine, policy, routes)
        del trainer_lps, routes
    samples, metas, outputs = gen.samples, gen.metas, gen.outputs
    if gen.partial is not None:  # only the groups whose completions have all ended are scored (and trained)
        done = [g for g, e in zip(gen.partial.groups, gen.partial.ended) if e]
        samples, metas = [s for g in done for s in g.samples], [m for g in done for m in g.metas]
        outputs = [s.completion_ids for s in samples]
    error, scored = None, None
    with timed(times, "reward"):
        try:
            scored = score(task, outputs, metas, step, cfg)
        except RewardError as e:
            error = RewardError(not_applied(e, step))
    world.raise_if_any(error)
    return Round(samples, metas, scored, report, gen.extra, gen.partial)


def advantages(rewards: torch.Tensor, cfg) -> torch.Tensor:
    """The group-relative advantages of a step's rewards (prompt-major, --group-size a prompt) as the run's
    --scale-rewards and --advantage-std ask."""
    return grpo_advantages(rewards, cfg.group_size, scale=cfg.scale_rewards, std=cfg.advantage_std)


def not_applied(e: Exception, step: int) -> str:
    """The one line of an error during a step's rollout: what it was, and that nothing was lost."""
    return f"{e}; nothing is lost: step {step} was not applied, and the last checkpoint (if any) is kept for --resume"


# -- the step's rollout ---------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """What a step trains on (this rank's share) and what it sampled (every round, this rank's)."""

    samples: list
    """Trained sequences of this rank: its share of the kept groups (or a Placeholder when that is empty)."""
    metas: list
    advantages: torch.Tensor
    """float32 [len(samples)]: group-relative, over every rank's kept groups (0 for a Placeholder)."""
    sampled: list
    """Every sequence this rank sampled this step (every round, kept or not)."""
    sampled_metas: list
    sampled_rewards: torch.Tensor
    sampled_per_func: torch.Tensor
    names: list[str]
    report: ParityReport
    metrics: dict
    """reward/<func>, reward_metric/<name>, dynamic/*, episode/* scalars (already over every rank)."""


def _merge(a: ParityReport | None, b: ParityReport) -> ParityReport:
    if a is None:
        return b
    routes = b.routes if a.routes is None else (a.routes if b.routes is None else a.routes.merged(b.routes))
    return ParityReport(a.tokens_compared + b.tokens_compared, a.tokens_different + b.tokens_different,
                        max(a.max_abs_diff, b.max_abs_diff), routes=routes)


def draw(run: Run, step: int) -> list:
    """This rank's share of the next round's prompts of `step` (--prompts-per-step, times --oversample; every rank
    draws the same list: a bad row fails every rank alike)."""
    try:
        return shard_of(run.source.draw(run.cfg.prompts_per_round), run.world)
    except DatasetError as e:
        raise DatasetError(not_applied(e, step)) from None


def collect(run: Run, step: int, times: dict, started=None) -> Rollout:
    """The step's rollout (module docstring) on this rank. `started`: its first round's sampling, begun
    earlier (spirl.loops.ahead: run.source.begin(step) and this rank's draw done then, the engine's
    Generated its result())."""
    cfg, world = run.cfg, run.world
    want = cfg.prompts_per_step
    if started is None:
        run.source.begin(step)
    if cfg.partial_rollout_tokens:
        return _collect_partial(run, step, times, started)
    rounds: list[Round] = []
    filters = run.filters
    kept = KeptGroups(cfg.group_size, filters, step)
    rounds_allowed = cfg.dynamic_sampling_max_rounds if filters else 1
    while len(rounds) < rounds_allowed and (not filters or len(kept.groups) < want):
        if started is not None and not rounds:
            rnd = sample_round(run, step, 0, None, times, generated=started)
        else:
            rnd = sample_round(run, step, len(rounds), draw(run, step), times)
        rounds.append(rnd)
        if filters:
            try:
                kept.add(rnd, world)
            except FilterError as e:  # every rank runs the filters on the same gathered groups: all fail alike
                raise FilterError(not_applied(e, step)) from e
    metrics = _sampled_metrics(rounds, world)
    if filters:
        metrics.update(kept.metrics(len(rounds), want))
        if len(kept.groups) < want and world.is_main:
            log.warning("step %d: the filters (%s) kept %d of %d groups in %d rounds (--dynamic-sampling-max-rounds); "
                        "training on those %d", step, ", ".join(f.name for f in filters), len(kept.groups), want,
                        len(rounds), len(kept.groups))
        samples, metas, adv = kept.share(want, cfg, world)
    else:
        rnd = rounds[0]
        samples, metas = rnd.samples, rnd.metas
        every = torch.cat(world.gather(rnd.scored.rewards))  # rank order = one process's order (batch std)
        adv = shard_of(advantages(every, cfg), world)
    report = None
    for rnd in rounds:
        report = _merge(report, rnd.report)
    sampled, sampled_metas = [s for r in rounds for s in r.samples], [m for r in rounds for m in r.metas]
    return Rollout(samples, metas, adv, sampled, sampled_metas, torch.cat([r.scored.rewards for r in rounds]),
                   torch.cat([r.scored.per_func for r in rounds]), rounds[0].scored.names, report, metrics)


def carry_open(run: Run, pr: PartialRound) -> None:
    """--partial-rollout-tokens: the groups of every rank's round `pr` that have not ended become the carried ones,
    in the order their prompts were drawn (collective). Read from the engine's output only, so a step may take
    its share before this round is checked (spirl.loops.trainer: TrainConfig.checks_after_update); once per round
    (asked again when the round is collected)."""
    if run.partial.settled is pr:
        return
    run.partial.settled = pr
    every = run.world.gather((pr.groups, pr.ended))
    run.partial.carried = sorted((grp for groups, ended in every for grp, e in zip(groups, ended) if not e),
                                 key=lambda grp: grp.origin)


def _collect_partial(run: Run, step: int, times: dict, started) -> Rollout:
    """--partial-rollout-tokens: one engine call for the new prompts and this rank's share of the carried groups;
    the groups that ended, of every rank in the order their prompts were drawn, are trained on (shared out as the
    filters' kept groups are); the others are carried (spirl.loops.partial)."""
    world = run.world
    if started is not None:
        rnd = sample_round(run, step, 0, None, times, generated=started)
    else:
        rnd = sample_round(run, step, 0, draw(run, step), times, carried=run.partial.share(world))
    pr, g = rnd.partial, run.cfg.group_size
    kept = KeptGroups(g, [], step)
    every_done = []
    for groups, ended, rewards, per_func in world.gather((pr.groups, pr.ended, rnd.scored.rewards,
                                                         rnd.scored.per_func)):
        j = 0
        for grp, e in zip(groups, ended):
            if e:
                every_done.append((grp.origin, grp, rewards[j:j + g], per_func[j:j + g]))
                j += g
    every_done.sort(key=lambda t: t[0])
    kept.groups = [(grp.samples, grp.metas, r, pf) for _, grp, r, pf in every_done]
    carry_open(run, pr)
    samples, metas, adv = kept.share(len(kept.groups), run.cfg, world)
    metrics = {**_sampled_metrics([rnd], world), **run.partial.scalars([grp for _, grp, _, _ in every_done])}
    return Rollout(samples, metas, adv, rnd.samples, rnd.metas, rnd.scored.rewards, rnd.scored.per_func,
                   rnd.scored.names, rnd.report, metrics)


class KeptGroups:
    """The filters' choice (spirl/loops/filters.py): the groups every filter keeps, of every round and rank, in the
    order they were sampled, and how many each filter dropped (the first that drops a group counts it)."""

    def __init__(self, group_size: int, filters: list[GroupFilter], step: int):
        self.g, self.filters, self.step = group_size, filters, step
        self.groups: list[tuple] = []
        """(sequences, metas, rewards, per_func) of each kept group, every rank's, in order."""
        self.sampled = 0
        self.dropped = {f.name: 0 for f in filters}

    def add(self, rnd: Round, world: World) -> None:
        """Keep the groups of a round that pass every filter (gathered from every rank, in rank order)."""
        g = self.g
        for seqs, metas, rewards, per_func in world.gather((rnd.samples, rnd.metas, rnd.scored.rewards,
                                                              rnd.scored.per_func)):
            for i in range(0, len(seqs), g):
                group = (seqs[i:i + g], metas[i:i + g], rewards[i:i + g], per_func[i:i + g])
                self.sampled += 1
                drop = next((f for f in self.filters if not f.keep(Group(*group), self.step)), None)
                if drop is None:
                    self.groups.append(group)
                else:
                    self.dropped[drop.name] += 1

    def metrics(self, rounds: int, want: int) -> dict:
        used = min(len(self.groups), want)
        return {"dynamic/rounds": float(rounds), "dynamic/groups_sampled": float(self.sampled),
                "dynamic/groups_dropped": float(sum(self.dropped.values())), "dynamic/groups_kept": float(used),
                "dynamic/groups_unused": float(len(self.groups) - used),
                "dynamic/round_limit": float(len(self.groups) < want),
                **{f"filter/{name}/dropped": float(n) for name, n in self.dropped.items()}}

    def share(self, want: int, cfg, world: World) -> tuple[list, list, torch.Tensor]:
        """This rank's (samples, metas, advantages) of the first `want` kept groups: advantages over all of
        them, then a contiguous share per rank (shares differ by at most one group; a rank left without one
        trains a zero-weight Placeholder, so that the collectives pair up)."""
        g, kept = self.g, self.groups[:want]
        rewards = torch.cat([k[2] for k in kept]) if kept else torch.zeros(0)
        adv_all = advantages(rewards, cfg) if kept else rewards
        share = even_slices(len(kept), world.size)[world.rank]
        mine = kept[share]
        samples = [s for k in mine for s in k[0]]
        metas = [m for k in mine for m in k[1]]
        adv = adv_all[share.start * g:share.stop * g]
        if not samples and kept:  # this rank trains nothing this step: a zero-weight pass keeps collectives paired
            samples, metas, adv = [Placeholder(kept[0][0][0])], [kept[0][1][0]], torch.zeros(1)
        return samples, metas, adv


def _sampled_metrics(rounds: list[Round], world: World) -> dict:
    """reward/<func> (each function's mean over the samples it applied to, every round and rank),
    reward_metric/<name> (the reward functions' log_metric values, averaged), episode/* (multi-turn)."""
    out = {}
    if rounds[0].scored.per_function:
        per_func = torch.cat(world.gather(torch.cat([r.scored.per_func for r in rounds])))
        for j, name in enumerate(rounds[0].scored.names):
            col = per_func[:, j]
            col = col[~torch.isnan(col)]
            if col.numel():  # a function that applied to no sample this step logs nothing
                out[f"reward/{name}"] = float(col.mean())
    logged: dict[str, list[float]] = {}
    for part in world.gather([r.scored.metrics for r in rounds]):
        for m in part:
            for k, v in m.items():
                logged.setdefault(k, []).extend(v)
    for k, v in sorted(logged.items()):
        out[f"reward_metric/{k}"] = sum(v) / len(v)
    if rounds[0].extra:
        extra = {k: sum(r.extra[k] for r in rounds) / len(rounds) for k in rounds[0].extra}
        out.update(world.mean_over_ranks(extra))
    return out

