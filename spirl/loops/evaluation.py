"""Held-out evaluation of the policy through the rollout engine (`--eval-every N`).

A task with an eval set defines `eval_problems() -> [(prompt ids, meta)]`: a fixed list (fixed
seed, fixed size, disjoint from its training prompts); `--eval-size N` evaluates its first N. Each problem is answered greedily by the
same engine that samples the rollouts (so the eval sees exactly the policy being trained), and a
completion counts as correct when the task's reward gives it the full reward, 1.0 (for --dataset:
the weighted sum of the --reward functions, as in training).
  eval/accuracy   share of problems whose greedy completion is correct
  eval/pass@k     with --eval-pass-k k: share of problems with at least one correct completion
                  among k samples at --temperature (a fixed sampling seed, so repeatable)
  eval/reward/<f> tasks scored by named reward functions (--dataset, reasoning_gym): each function's
                  mean over the greedy completions it applied to
"""

from __future__ import annotations

import torch

from ..core.config import ConfigError
from ..core.distributed import World
from ..tasks.rewards import score

EVAL_SEED = 20_251_123
"""Sampling seed of pass@k (fixed: the same policy always gets the same eval)."""


def require_eval_set(task, cfg) -> None:
    """Refuse --eval-every for a task without a held-out set, and an --eval-size larger than the set (one
    line: what to do)."""
    if not cfg.eval_every:
        return
    if getattr(cfg, "dataset", "") and not getattr(cfg, "eval_dataset", ""):
        raise ConfigError("--eval-every with --dataset needs --eval-dataset PATH (held-out prompts, scored by the same "
                          "--reward functions); or use --eval-every 0")
    if not hasattr(task, "eval_problems"):
        raise ConfigError(f"--eval-every: task {cfg.task!r} has no held-out eval set; use --eval-every 0 "
                          "or a task with eval_problems() (e.g. arith)")
    n = len(task.eval_problems())
    if cfg.eval_size > n:
        what = f"--eval-dataset {cfg.eval_dataset}" if getattr(cfg, "dataset", "") else f"task {cfg.task!r}"
        raise ConfigError(f"--eval-size {cfg.eval_size}: {what} has {n} held-out problems; pass at "
                          f"most {n} (or 0 for all)")


def eval_problems(task, cfg) -> list:
    """The problems an eval answers: the task's held-out set, its first --eval-size of them."""
    return task.eval_problems()[:cfg.eval_size or None]


def solved(task, completions: list[list[int]], metas: list, step: int = 0, cfg=None) -> tuple[torch.Tensor, object]:
    """bool [N]: each completion is correct (the task gives it the full reward, >= 1.0), and the Scored batch."""
    scored = score(task, completions, metas, step, cfg)
    return torch.nan_to_num(scored.rewards, nan=0.0) >= 1.0, scored


def evaluate(engine, task, cfg, world=None, step: int = 0) -> dict[str, float]:
    """eval/* scalars of the current policy on the task's held-out problems (`eval_problems`). On several ranks
    (spirl.core.distributed.World) each rank answers every world.size-th problem and the counts are
    summed, so the scalars are the one-process ones. `step`: what the reward functions' trainer_state says."""
    world = world or World()
    problems = eval_problems(task, cfg)
    mine = problems[world.rank::world.size]
    prompts, metas = [ids for ids, _ in mine], [meta for _, meta in mine]
    completions = engine.greedy(prompts, max_tokens=cfg.max_new_tokens)
    correct, scored = solved(task, completions, metas, step, cfg) if mine else (torch.zeros(0, dtype=torch.bool), None)
    counts = [int(correct.sum())]
    k = cfg.eval_pass_k
    if k:
        samples = engine.generate(prompts, n=k, max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                  seed=[EVAL_SEED] * len(prompts), min_p=cfg.min_p, top_k=cfg.top_k, top_p=cfg.top_p)
        right = solved(task, [s.completion_ids for s in samples], [m for m in metas for _ in range(k)], step, cfg)[0] \
            if mine else torch.zeros(0, dtype=torch.bool)
        counts.append(int(right.view(-1, k).any(dim=1).sum()) if mine else 0)
    names = scored.names if getattr(scored, "per_function", False) else []
    if world.sharded:  # a rank without eval problems scored nothing: the names from one that did
        names = next((n for n in world.gather(names) if n), [])
    sums = []
    for j in range(len(names)):  # each function's (sum, count) over the problems it applied to
        col = scored.per_func[:, j] if scored is not None else torch.zeros(0)
        sums += [float(col.nan_to_num(0.0).sum()), float((~torch.isnan(col)).sum())]
    first = len(counts)  # where the functions' (sum, count) pairs start
    counts = world.all_sum(counts + sums)
    out = {"eval/accuracy": counts[0] / len(problems)}
    if k:
        out[f"eval/pass@{k}"] = counts[1] / len(problems)
    for j, name in enumerate(names):
        total, n = counts[first + 2 * j:first + 2 * j + 2]
        if n:
            out[f"eval/reward/{name}"] = total / n
    return out
