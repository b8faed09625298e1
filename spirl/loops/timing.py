"""Phase timing of a step: seconds and, on a GPU, peak torch memory per phase (time/<phase>,
memory/peak_gib/<phase>)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


@contextmanager
def timed(times: dict, key: str):
    """Adds the phase's seconds to times[key] and, on a GPU, its peak torch allocation (GiB) to
    times["peak:" + key] (the max over the phase's repetitions)."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30
        times["peak:" + key] = max(times.get("peak:" + key, 0.0), peak)
    times[key] = times.get(key, 0.0) + time.perf_counter() - t0


def phase_metrics(times: dict, world=None) -> dict[str, float]:
    """time/<phase> seconds and memory/peak_gib/<phase> from what `timed` collected; on several ranks
    (`world`, spirl.core.distributed.World; collective) the peak is the busiest GPU's, the times this rank's,
    and time/max/<phase> the slowest rank's (a rank that waits for another at a collective spends the
    difference in no phase of its own)."""
    out = {}
    if world is not None and world.sharded:
        every = world.gather(dict(times))
        keys = {k for t in every for k in t}
        times = {**times, **{k: max(t.get(k, 0.0) for t in every) for k in keys if k.startswith("peak:")}}
        out.update({f"time/max/{k}": max(t.get(k, 0.0) for t in every) for k in keys if not k.startswith("peak:")})
    for k, v in times.items():
        out[f"memory/peak_gib/{k[5:]}" if k.startswith("peak:") else f"time/{k}"] = v
    return out


def build_metrics(built: int, world=None) -> dict[str, float]:
    """triton/builds: the Triton kernels this rank built in the step; on several ranks (collective) also
    triton/max/builds, the most any rank built (a rank that meets new shapes compiles while the others wait)."""
    out = {"triton/builds": float(built)}
    if world is not None and world.sharded:
        out["triton/max/builds"] = float(world.all_max(float(built)))
    return out
