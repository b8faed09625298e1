"""Signals during a run: SIGINT stops it where it is, SIGTERM (a scheduler's preemption) at the next safe point.

SIGINT stops the run where it is (logging a step and writing a checkpoint finish first: `Signals.deferred`);
the logs are flushed, no partial checkpoint is left, and the one line (`interrupted`) says which --resume
continues the run (exit status 128 + the signal). SIGTERM during training (Slurm, Kubernetes, torchrun stopping
its workers) only asks the run to stop at its next safe point, on every rank together (spirl.loops.run); more
SIGTERMs change nothing (a scheduler may signal every process of the job and torchrun forward it again). During
set-up SIGTERM stops at once: nothing to save.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ..core import checkpoint as ckpt
from ..core.errors import UserError

log = logging.getLogger("spirl.loops.signals")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (`signum`)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """SIGINT (and SIGTERM before `graceful` is set) raises Interrupted: at once, or inside `deferred()`
    when the block ends (a second signal meanwhile raises at once). Once `graceful` is set (the step
    loop runs), SIGTERM only sets `stop_requested`: the run stops at its next safe point (spirl.loops.run).
    Installed only in the main thread; restored on exit."""

    def __init__(self):
        self.depth, self.pending, self.previous = 0, None, {}
        self.graceful = False
        self.stop_requested = False
        self.stop_requested_at: float | None = None
        """time.monotonic() of the SIGTERM that set stop_requested."""

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGTERM and self.graceful:
            if not self.stop_requested:
                self.stop_requested, self.stop_requested_at = True, time.monotonic()
                log.warning("SIGTERM: stopping at the next safe point (after this rollout or this step), then a "
                            "checkpoint and exit 0 (SIGINT stops at once)")
            return
        if self.depth and self.pending is None:
            self.pending = signum
            return
        raise Interrupted(signum)

    @contextmanager
    def deferred(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)


def interrupted(e: KeyboardInterrupt, cfg, progress) -> UserError:
    """The one line (and exit status) of a run stopped by `e`: where it was, and how to continue it."""
    signum = getattr(e, "signum", signal.SIGINT)
    step, done = progress.step, progress.done
    if step is None:
        where = "during setup"
    elif done == step:
        where = f"after step {step}; the logs are flushed"
    else:
        where = f"during step {step} (not logged, not saved); the logs are flushed"
    root = Path(cfg.checkpoint_dir) / cfg.run_name
    try:
        latest = ckpt.resolve(root)
    except ckpt.CheckpointError:
        latest = None
    if latest is not None:
        how = f"the last checkpoint is {latest}: continue with --resume {root}"
    elif cfg.resume:
        how = f"no new checkpoint was written: continue with --resume {cfg.resume}"
    else:
        how = "no checkpoint was written yet: start the run again"
    return UserError(f"interrupted by {signal.Signals(signum).name} {where}; {how}", 128 + signum)
