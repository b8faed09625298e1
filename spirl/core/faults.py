"""Faults on several ranks: a rank that dies or fails stops every rank within seconds, in one line naming it.

Why: a collective waits for every rank. When one rank dies (killed, crashed, out of host memory) the
others block inside the collective (with NCCL: in a CUDA synchronize), where Python never runs again,
so no signal handler or exception can act; torchrun's SIGTERM goes unanswered until its SIGKILL 30 s
later, and nothing says which rank died. And a rank that fails with an exception outside a collective
exits alone, leaving the others to wait the same way.

`PeerWatch` is a daemon thread in every rank (spirl.loops.run starts it under torchrun). Every
`interval` seconds it looks at the other ranks through the job's c10d store (the TCPStore torchrun
hosts at MASTER_ADDR:MASTER_PORT, one client connection of its own) and the operating system:
  * a rank that fails with an exception publishes its one-line error under the store key `failed`
    (`PeerWatch.failing`) before it exits; the first rank to publish wins (compare_set), so every
    rank reports the same first cause;
  * a rank on this host whose process is gone (or a zombie) is dead: pids are exchanged at start;
  * a rank on another host whose heartbeat (a store counter each watch adds to) has not moved for
    `stale_after` seconds is dead or hung; so is the store itself when it stops answering that long.
A watch that finds a failure publishes it and then stops its own rank: it logs the line, waits for a
checkpoint this rank is writing on its own to be complete (`local_write`: nothing half-written is
left either way, checkpoints are atomic), flushes the logs, writes the line to stderr and exits with
status 9 (EXIT_PEER_FAILED) with `os._exit`, since the main thread may never return from the
collective. A rank whose main thread is itself reporting an error (`failing`) is left to finish that.
Ranks mark themselves `done` before the run's last barrier, so a rank that ends first is not taken
for dead.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager

from .errors import EXIT_PEER_FAILED

log = logging.getLogger("spirl.core.faults")

GRACE_HINT_S = 10.0
"""A peer killed this long after this rank's SIGTERM is reported as killed by the launcher's grace period."""


def _process_gone(pid: int) -> bool:
    """The process `pid` on this host has exited (or is a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - flushing what can be flushed on the way out
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


class PeerWatch:
    """The watch of one rank (module docstring). `store`: a c10d Store client of the job's store (None:
    connect to MASTER_ADDR:MASTER_PORT); `peers`: {rank: (host, pid)} of every rank, this one included
    (World.gather of `identity()` at start). `exit` is os._exit, replaceable in tests."""

    def __init__(self, rank: int, peers: dict[int, tuple[str, int]], store=None, interval: float = 1.0,
                 stale_after: float = 10.0, prefix: str | None = None, exit=os._exit):
        self.rank, self.peers = rank, peers
        self.interval, self.stale_after = interval, stale_after
        if prefix is None:
            from .distributed import job_key

            prefix = job_key("watch")
        self.prefix = prefix
        if store is None:
            from .distributed import job_store

            store = job_store()
        self.store = store
        self._exit = exit
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._handling = False
        self._writing = 0
        self._lock = threading.Lock()
        self.verdict: str | None = None
        """The failure this watch found or read from the store (one line), once it has one."""
        self.stopping = lambda: None
        """When (time.monotonic()) this rank got the SIGTERM it is stopping after, or None (spirl.loops.run sets
        it). A peer found killed GRACE_HINT_S or more after it was most likely killed by its launcher at the end
        of the grace period, and the line says so; sooner, the death more likely caused the SIGTERM (torchrun
        signals the survivors of a dead rank)."""
        self._beats: dict[int, tuple[int, float]] = {}
        self._store_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="spirl-peer-watch", daemon=True)

    @staticmethod
    def identity() -> tuple[str, int]:
        return socket.gethostname(), os.getpid()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def start(self) -> "PeerWatch":
        self._beat()
        self._thread.start()
        return self

    # -- what the main thread tells the watch ------------------------------------------------------

    def reporting(self) -> None:
        """This rank's main thread is reporting an error and will exit: the watch no longer stops it."""
        with self._lock:
            self._handling = True

    def failing(self, line: str) -> str:
        """This rank's main thread is reporting an error (`line`, its one-line message): publish it
        unless another rank's failure came first, and leave this rank to its own error path. Returns
        what `failed` holds then: `rank <r>: <line>` of the first rank that failed."""
        self.reporting()
        return self._publish(f"rank {self.rank}: {line}")

    def peer_failure(self, wait: float = 0.0) -> str | None:
        """Another rank's failure, if one is known (published or found) within `wait` seconds."""
        deadline = time.monotonic() + wait
        while True:
            found = self._read_failed() or self.verdict
            if found and not found.startswith(f"rank {self.rank}:"):
                return found
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(self.interval, 0.2))

    @contextmanager
    def local_write(self):
        """Around work this rank does alone that must not be cut (rank 0 writing a checkpoint)."""
        with self._lock:
            self._writing += 1
        try:
            yield
        finally:
            with self._lock:
                self._writing -= 1

    def done(self) -> None:
        """This rank finished the run: the others must not take its exit for a failure."""
        try:
            self.store.set(self._key(f"done/{self.rank}"), "1")
        except Exception:  # noqa: BLE001 - the store going away at the very end is no failure
            pass

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval + 1)

    # -- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            found = self.check()
            if found and not self._stop.is_set():
                self._stop_this_rank(found)
                return

    def check(self) -> str | None:
        """One look at the peers: the first failure (one line) or None. Publishes what it finds."""
        try:
            self._beat()
            failed = self._read_failed()
            if failed:
                self.verdict = failed
                return failed
            dead = self._find_dead()
            self._store_ok = time.monotonic()
        except Exception as e:  # noqa: BLE001 - the store unreachable: judged by how long it lasts
            if time.monotonic() - self._store_ok < self.stale_after:
                return None
            self.verdict = (f"the job's c10d store stopped answering for {self.stale_after:g} s "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:120]}): torchrun or its node is gone")
            return self.verdict
        if dead:
            self.verdict = self._publish(dead)
            return self.verdict
        return None

    def _beat(self) -> None:
        self.store.add(self._key(f"beat/{self.rank}"), 1)

    def _read_failed(self) -> str | None:
        key = self._key("failed")
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode(errors="replace")

    def _publish(self, line: str) -> str:
        """Set `failed` to `line` unless it is set already; returns what it holds."""
        try:
            return self.store.compare_set(self._key("failed"), "", line).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store gone: this rank's own view is all there is
            return line

    def _find_dead(self) -> str | None:
        now = time.monotonic()
        for r, (host, pid) in sorted(self.peers.items()):
            if r == self.rank or self.store.check([self._key(f"done/{r}")]):
                continue
            if host == self._host:
                if _process_gone(pid):
                    since = self.stopping()
                    if since is not None and now - since >= GRACE_HINT_S:
                        return (f"rank {r} (pid {pid} on {host}) was killed {now - since:.0f} s after the job's "
                                "SIGTERM, before its safe point and checkpoint: most likely its launcher's grace "
                                "period ended (torchrun SIGKILLs 30 s after SIGTERM); the latest complete checkpoint "
                                "is kept: signal the job earlier (Slurm: --signal=TERM@120)")
                    return (f"rank {r} (pid {pid} on {host}) exited without reporting an error: killed (SIGKILL, "
                            "the out-of-memory killer) or crashed")
                continue
            beat = self.store.add(self._key(f"beat/{r}"), 0)
            last, since = self._beats.get(r, (-1, now))
            if beat != last:
                self._beats[r] = (beat, now)
            elif now - since > self.stale_after:
                return (f"rank {r} (on {host}) sent no heartbeat for {self.stale_after:g} s: its process or node "
                        "died, or it hangs")
        return None

    def _stop_this_rank(self, line: str) -> None:
        with self._lock:
            handling = self._handling
        if handling:  # the main thread reports an error itself and exits
            return
        log.error("rank %d stops: %s", self.rank, line)
        said = False
        while True:
            with self._lock:
                writing = self._writing
            if not writing:
                break
            if not said:
                log.error("rank %d finishes the checkpoint it is writing first", self.rank)
                said = True
            time.sleep(0.2)
        self._let_failing_rank_exit_first(line)
        with self._lock:
            if self._handling:
                return
        _flush_logs()
        try:
            sys.stderr.write(f"error: {line}; rank {self.rank} stopped too (exit status {EXIT_PEER_FAILED})\n")
            sys.stderr.flush()
        finally:
            self._exit(EXIT_PEER_FAILED)


    def _let_failing_rank_exit_first(self, line: str, limit: float = 5.0) -> None:
        """A rank that published its own error exits by itself: wait (up to `limit` s) until it has, so
        that torchrun names it, not this rank, as the first failure."""
        head = line.split(":", 1)[0]
        if not head.startswith("rank ") or not head[5:].isdigit():
            return
        host, pid = self.peers.get(int(head[5:]), ("", 0))
        deadline = time.monotonic() + (limit if host == self._host else limit / 2)
        while time.monotonic() < deadline and not (host == self._host and _process_gone(pid)):
            time.sleep(0.1)
