"""spirl/loops/timing.py: phase seconds and peaks as metrics; on several ranks the slowest rank's phases too."""

from __future__ import annotations

from spirl.loops.timing import build_metrics, phase_metrics, timed


class TwoRanks:
    """A stand-in World whose gather returns this rank's dict and another rank's."""

    sharded = True

    def __init__(self, other: dict):
        self.other = other

    def gather(self, obj):
        return [obj, self.other]

    def all_max(self, value: float) -> float:
        return max(value, self.other["builds"])


def test_one_rank_logs_its_phases_and_peaks():
    times = {}
    with timed(times, "rollout"):
        pass
    times["step"] = 2.0
    out = phase_metrics(times)
    assert set(out) == {"time/rollout", "time/step"} and out["time/step"] == 2.0
    assert not any(k.startswith("time/max/") for k in out)


def test_several_ranks_log_this_ranks_times_the_slowest_ranks_and_the_busiest_peak():
    mine = {"rollout": 2.0, "parity": 0.5, "step": 6.3, "peak:rollout": 40.0}
    other = {"rollout": 4.6, "parity": 0.4, "reference": 0.1, "step": 6.3, "peak:rollout": 41.5}
    out = phase_metrics(mine, TwoRanks(other))
    assert out["time/rollout"] == 2.0 and out["time/parity"] == 0.5  # this rank's
    assert out["time/max/rollout"] == 4.6 and out["time/max/parity"] == 0.5 and out["time/max/reference"] == 0.1
    assert "time/reference" not in out  # a phase only the other rank had is not this rank's
    assert out["memory/peak_gib/rollout"] == 41.5 and "time/max/peak:rollout" not in out


def test_kernel_builds_this_ranks_and_on_several_ranks_the_most_any_rank_built():
    assert build_metrics(3) == {"triton/builds": 3.0}
    assert build_metrics(0, TwoRanks({"builds": 5})) == {"triton/builds": 0.0, "triton/max/builds": 5.0}
