"""Held-out evaluation of the policy through the rollout engine (issue 13: being written)."""

from __future__ import annotations


def evaluate(engine, task, cfg) -> dict[str, float]:
    """eval/* scalars of the current policy on the task's held-out problems."""
    raise NotImplementedError("evaluation is not written yet; run without --eval-every")
