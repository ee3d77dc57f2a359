"""Which processes wrote a save attempt, and whether one still runs (tierckpt_daemon.tier.writers):
a live process is known by its pid and start time, a dead or reused pid is not taken for it."""

from __future__ import annotations

import os
import subprocess
import sys

from tierckpt_daemon.tier.writers import any_alive, note_writer, start_time


def test_a_running_writer_is_alive_and_a_dead_one_is_not() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        writers: dict[int, int] = {}
        note_writer(writers, proc.pid)
        assert list(writers) == [proc.pid]
        assert any_alive(writers) is True
    finally:
        proc.kill()
        proc.wait(10)
    assert any_alive(writers) is False
    assert start_time(proc.pid) is None


def test_a_reused_pid_is_not_the_writer() -> None:
    me = os.getpid()
    started = start_time(me)
    assert started is not None
    assert any_alive({me: started - 1}) is False  # the same pid, another process's start
    assert any_alive({me: started}) is True


def test_no_pid_means_not_known() -> None:
    writers: dict[int, int] = {}
    note_writer(writers, None)
    note_writer(writers, 0)  # a caller in a pid namespace the daemon cannot see
    assert writers == {} and any_alive(writers) is None
