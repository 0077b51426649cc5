"""What the ranks' watchdog (executor/local_ranks.py LocalRanks) reads to tell a lost rank, step or no step.

- how a follower process ended, in words (`exit_text`);
- whether a step is running and for how long (`StepClock`: the driver's step opens it, the watchdog
  reads it), so a follower that stops answering is named once the step outlives the rank step
  timeout (EngineConfig.rank_step_timeout), instead of the driver waiting in a collective forever;
- which follower a hung step waits on (`silent_follower`): one that has not read the step's ring
  message, else one the OS reports stopped, else the first follower still running (a rank blocked in
  a collective looks the same as the one that holds it up, so the text says it is a guess).

Killing the named follower (and the host's others) is what bounds the driver's wait: its gloo
collective then ends with a closed connection, and the step raises the RankFailure recorded here.
A rank on another host cannot be killed from here, and one that is frozen (SIGSTOP, a paused VM)
cannot obey the driver's stop word either, so the driver's own collectives also carry a timeout
(`bound_collectives`: the rank step timeout plus COLLECTIVE_GRACE_S), set once the model is built
so that start-up compiles stay unbounded.
"""
from __future__ import annotations

import datetime
import logging
import signal
import threading
import time

logger = logging.getLogger(__name__)

# The watchdog acts at the rank step timeout; a collective of the driver gives up this much later.
COLLECTIVE_GRACE_S = 5.0


def exit_text(code: int) -> str:
    """A Popen return code in words: 'was killed by SIGKILL', 'exited with status 1'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def process_state(pid: int) -> str | None:
    """The one-letter state of /proc/<pid>/stat (R, S, D, T, t, Z...), None once the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name (field 2) is in parentheses and may hold spaces
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return None


class StepClock:
    """When the running step began (None between steps). Written by the step's thread, read by the
    watchdog: a float assignment is atomic, the lock only keeps begin/overdue consistent."""

    def __init__(self):
        self._lock = threading.Lock()
        self._since: float | None = None

    def begin(self) -> None:
        with self._lock:
            self._since = time.monotonic()

    def end(self) -> None:
        with self._lock:
            self._since = None

    def overdue(self, timeout_s: float) -> float | None:
        """Seconds the running step has taken, when that is more than timeout_s (0: never)."""
        with self._lock:
            since = self._since
        if not timeout_s or since is None:
            return None
        took = time.monotonic() - since
        return took if took > timeout_s else None


def silent_follower(procs: dict, lagging_readers: list[int], first_rank: int,
                    guess: bool = True) -> tuple[int, str] | None:
    """(rank, why it is named) of the follower a hung step waits on; None when none is running (or,
    without `guess`, when none lags or is stopped). procs: rank -> Popen of this host's followers;
    lagging_readers: ring reader indices (local rank - 1) that have not read the last step message."""
    running = {rank: proc for rank, proc in sorted(procs.items()) if proc.poll() is None}
    if not running:
        return None
    for reader in lagging_readers:
        rank = first_rank + 1 + reader
        if rank in running:
            return rank, "it has not read the step"
    for rank, proc in running.items():
        if process_state(proc.pid) in ("T", "t"):
            return rank, "its process is stopped"
    if not guess:
        return None
    rank = next(iter(running))
    return rank, "every follower read the step; the first one still running is named"


def bound_collectives(groups, timeout_s: float) -> None:
    """Give the driver's process groups (None entries skipped) and the default group a timeout of
    timeout_s + COLLECTIVE_GRACE_S per collective; timeout_s 0 leaves them as they are."""
    if not timeout_s:
        return
    import torch.distributed as dist
    limit = datetime.timedelta(seconds=timeout_s + COLLECTIVE_GRACE_S)
    for group in [dist.group.WORLD, *groups]:
        if group is None:
            continue
        try:
            group.set_timeout(limit)
        except (AttributeError, RuntimeError) as e:   # a backend without per-group timeouts
            logger.warning("collectives of %s keep their timeout: %s", group, e)
