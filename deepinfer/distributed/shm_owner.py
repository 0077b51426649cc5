"""Names of our /dev/shm segments that say which process created them, and a sweep of the ones whose
creator is gone.

The step ring (step_ring.py) and the shared Engram tables (shared_tables.py) unlink their segments as
soon as every local rank has mapped them, so a crash leaves one behind only if the creator is killed
in that short window (milliseconds to seconds: both are created once every reader is waiting). Such a
segment holds memory until reboot. So each name carries its creator's pid and the process's start
time (field 22 of /proc/PID/stat, in clock ticks since boot; a pid alone is reused), and every creator
first sweeps the segments of its kind whose creator no longer runs. A segment is swept only when:
- its name parses as ours (older or foreign names are left alone);
- /proc/PID is gone or belongs to a process started at another time (the creator died);
- it is older than STALE_AFTER_S: the window above is far shorter, so a live engine's segment in the
  middle of its start-up is never touched, even one from another PID namespace sharing /dev/shm.
Unlinking removes only the name: a process that still maps the segment keeps its memory. Without
/proc (no way to tell a dead creator from a live one) nothing is swept.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import time

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
STALE_AFTER_S = 60.0
_OWNED = re.compile(r"p(\d+)s(\d+)-([0-9a-f]+)")


def process_start(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) is in parentheses and may hold spaces: count fields after its ")"
    return int(stat[stat.rindex(")") + 2:].split()[19])


def owned_name(prefix: str) -> str:
    """prefix + "p<pid>s<start>-<random hex>": unique, and naming its creating process."""
    pid = os.getpid()
    return f"{prefix}p{pid}s{process_start(pid) or 0}-{secrets.token_hex(8)}"


def creator_alive(name: str, prefix: str) -> bool | None:
    """Whether the process that created segment `name` still runs; None when the name is not ours."""
    m = _OWNED.match(name[len(prefix):]) if name.startswith(prefix) else None
    if m is None:
        return None
    return process_start(int(m.group(1))) == int(m.group(2))


def sweep_stale(prefix: str, stale_after_s: float = STALE_AFTER_S, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments named `prefix`... whose creator is gone and that are older than
    `stale_after_s`; returns their names."""
    if process_start(os.getpid()) is None:   # no /proc here: no way to tell a dead creator from a live one
        return []
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(prefix)]
    except FileNotFoundError:
        return []
    swept, now = [], time.time()
    for name in sorted(names):
        if creator_alive(name, prefix) is not False:
            continue
        path = os.path.join(shm_dir, name)
        try:
            age = now - os.stat(path).st_mtime
            if age < stale_after_s:
                continue
            os.unlink(path)
        except FileNotFoundError:   # another creator swept it first
            continue
        except PermissionError:     # another user's: not ours to remove
            continue
        logger.warning("removed %s/%s (%.0f s old): its creator is gone, a crash left it behind",
                       shm_dir, name, age)
        swept.append(name)
    return swept
