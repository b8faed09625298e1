"""Held-out evaluation of the policy through the rollout engine (`--eval-every N`).

A task with an eval set defines `eval_problems() -> [(prompt ids, meta)]`: a fixed list (fixed
seed, fixed size, disjoint from its training prompts); `--eval-size N` evaluates its first N. Each problem is answered greedily by the
same engine that samples the rollouts (so the eval sees exactly the policy being trained), and a
completion counts as correct when the task's reward gives it the full reward, 1.0.
  eval/accuracy   share of problems whose greedy completion is correct
  eval/pass@k     with --eval-pass-k k: share of problems with at least one correct completion
                  among k samples at --temperature (a fixed sampling seed, so repeatable)
"""

from __future__ import annotations

from ..core.config import ConfigError
from ..core.distributed import World

EVAL_SEED = 20_251_123
"""Sampling seed of pass@k (fixed: the same policy always gets the same eval)."""


def require_eval_set(task, cfg) -> None:
    """Refuse --eval-every for a task without a held-out set, and an --eval-size larger than the set (one
    line: what to do)."""
    if not cfg.eval_every:
        return
    if not hasattr(task, "eval_problems"):
        raise ConfigError(f"--eval-every: task {cfg.task!r} has no held-out eval set; use --eval-every 0 "
                          "or a task with eval_problems() (e.g. arith)")
    n = len(task.eval_problems())
    if cfg.eval_size > n:
        raise ConfigError(f"--eval-size {cfg.eval_size}: task {cfg.task!r} has {n} held-out problems; pass at "
                          f"most {n} (or 0 for all)")


def eval_problems(task, cfg) -> list:
    """The problems an eval answers: the task's held-out set, its first --eval-size of them."""
    return task.eval_problems()[:cfg.eval_size or None]


def solved(task, completion_ids: list[int], meta) -> bool:
    """A completion is correct when the task gives it the full reward."""
    return task.reward(completion_ids, meta) >= 1.0


def evaluate(engine, task, cfg, world=None) -> dict[str, float]:
    """eval/* scalars of the current policy on the task's held-out problems (`eval_problems`). On several ranks
    (spirl.core.distributed.World) each rank answers every world.size-th problem and the counts are
    summed, so the scalars are the one-process ones."""
    world = world or World()
    problems = eval_problems(task, cfg)
    mine = problems[world.rank::world.size]
    prompts = [ids for ids, _ in mine]
    completions = engine.greedy(prompts, max_tokens=cfg.max_new_tokens)
    counts = [sum(solved(task, c, meta) for c, (_, meta) in zip(completions, mine))]
    k = cfg.eval_pass_k
    if k:
        samples = engine.generate(prompts, n=k, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                  seed=[EVAL_SEED] * len(prompts), min_p=cfg.min_p, top_k=cfg.top_k, top_p=cfg.top_p)
        counts.append(sum(any(solved(task, s.completion_ids, meta) for s in samples[i * k:(i + 1) * k])
                          for i, (_, meta) in enumerate(mine)))
    counts = world.all_sum(counts)
    out = {"eval/accuracy": counts[0] / len(problems)}
    if k:
        out[f"eval/pass@{k}"] = counts[1] / len(problems)
    return out
