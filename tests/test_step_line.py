"""The step line simple_rl.py logs: `kl` only when the step has a KL term, and the step's own wall
clock (time/step) rather than a sum that would count it twice."""

from __future__ import annotations

import logging

from spirl.core.metrics import MetricsLogger


def _line(tmp_path, caplog, scalars):
    logger = MetricsLogger(tmp_path / "run", {"test": True})
    with caplog.at_level(logging.INFO, logger="spirl.core.metrics"):
        logger.log_step(1, scalars, 3)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1/3")][-1]


def test_step_line_prints_kl_only_with_a_kl_term(tmp_path, caplog):
    base = {"reward_mean": 0.5, "reward_std": 0.1, "loss": 0.25, "parity/tokens_different": 0,
            "parity/tokens_compared": 64, "time/rollout": 1.0, "time/backward": 0.5, "time/step": 1.75}
    plain = _line(tmp_path / "a", caplog, base)
    assert " kl " not in plain and "nan" not in plain and plain.endswith("0/64 diff  1.8s")
    with_kl = _line(tmp_path / "b", caplog, {**base, "kl_div": 0.0123})
    assert "  kl 1.23e-02  " in with_kl
