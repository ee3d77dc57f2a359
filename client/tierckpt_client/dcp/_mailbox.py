"""Mailboxes: how DCP's helper process (PROCESS-mode ``async_save``) tells the trainer something
without a round trip to the daemon.

The trainer makes a pipe of its own per key and hands the helper its name, ``(pid, fd, inode)``,
with the pickled writer. The helper opens it through ``/proc/<pid>/fd/<fd>`` (as ``_arena``
reopens staged files; only processes of the same user may), checks that it is that pipe (another
process may have taken the pid), and writes one JSON line; the trainer reads what was sent at its
next ``stage``. Two things travel this way: the next save's pre-lease (``_prelease``) and which
items this rank wrote (``_assign``). Best effort: a line that does not arrive costs the next save
a round trip or a full copy, never a wrong save.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Hashable
from typing import Any

Mailbox = tuple[int, int, int]  # (pid, write fd, pipe inode)


class Mailboxes:
    """The trainer's end: one pipe per key, made on first use and kept for the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pipes: dict[Hashable, tuple[int, int]] = {}  # key -> (read fd, write fd)

    def box(self, key: Hashable) -> Mailbox:
        """Where a helper process sends this process what belongs to ``key``."""
        with self._lock:
            pipe = self._pipes.get(key)
            if pipe is None:
                pipe = self._pipes[key] = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        return os.getpid(), pipe[1], os.fstat(pipe[1]).st_ino

    def read(self, key: Hashable, limit: int) -> list[bytes]:
        """The lines sent for ``key`` since the last read (up to ``limit`` bytes); none if no
        mailbox was made for it or nothing was sent."""
        pipe = self._pipes.get(key)
        if pipe is None:
            return []
        try:
            return os.read(pipe[0], limit).splitlines()
        except BlockingIOError:  # nothing sent
            return []


def send(box: Mailbox, value: Any) -> bool:
    """Send ``value`` (JSON) as one line to the process that made ``box``; whether it got
    there."""
    pid, fd, ino = box
    line = json.dumps(value).encode() + b"\n"
    try:
        out = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # the trainer is gone
        return False
    try:
        st = os.fstat(out)
        if not stat.S_ISFIFO(st.st_mode) or st.st_ino != ino:  # another process took its pid
            return False
        return os.write(out, line) == len(line)
    except OSError:
        return False
    finally:
        os.close(out)
