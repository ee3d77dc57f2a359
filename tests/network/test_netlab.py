"""The network lab itself: it says why it cannot run, and it removes what a crashed run left
without touching a live session's namespaces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import netlab

pytestmark = pytest.mark.network


def test_missing_tools_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither ip nor nft
    why = netlab.unavailable()
    if os.geteuid() != 0:
        assert why is not None and "root" in why
    else:
        assert why == "`ip` is not installed (Debian: apt-get install iproute2)"


def test_stale_namespaces_of_a_dead_run_are_removed(network_lab: None) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    stale = f"{netlab.PREFIX}{dead.pid}-0-n0"  # as a run that died would have left it
    ours = f"{netlab.PREFIX}{os.getpid()}-stale-test"  # a live session's
    for ns in (stale, ours):
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:
        # A process left running in the stale namespace (a daemon of the dead run) goes too.
        left = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])
        netlab.wait_for("the leftover to run", lambda: subprocess.run(
            ["ip", "netns", "pids", stale], capture_output=True, text=True, timeout=30
        ).stdout.strip(), 30)  # fmt: skip
        assert stale in netlab.reap_stale()
        assert left.wait(30) == -9
        present = netlab.namespaces()
        assert stale not in present and ours in present
    finally:
        for ns in (stale, ours):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
