"""Which processes wrote a save attempt, and whether any of them still runs.

A trainer killed mid-save leaves its attempt's sealed files behind; the sweep reclaims them after
``lease_ttl_s`` (:mod:`tierckpt_daemon.tier.housekeeping`). Until then an operator sees the attempt
(``tierckpt inspect``) and may free it (``tierckpt rm --abandoned``), which the daemon refuses
while a writer still runs: it knows each sealing process from the kernel (``SO_PEERCRED``, see
:mod:`tierckpt_daemon.tier.tenants`) and tells a live one from a reused pid by the process's start
time in ``/proc/<pid>/stat``. A pid of 0 (the caller is in a pid namespace the daemon cannot see)
is not recorded: liveness is then unknown, and the operator decides.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of process ``pid``, or None if it does not run."""
    if pid <= 0:
        return None
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; field 22 is starttime.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def note_writer(writers: dict[int, int], pid: int | None) -> None:
    """Record the sealing process ``pid`` (if the daemon can see it) in ``writers``."""
    if pid is None or pid in writers:
        return
    started = start_time(pid)
    if started is not None:
        writers[pid] = started


def any_alive(writers: dict[int, int]) -> bool | None:
    """Whether a recorded writer still runs (None: none was recorded, so it is not known)."""
    if not writers:
        return None
    return any(start_time(pid) == started for pid, started in writers.items())
