"""The ``tierckpt`` CLI for operators (issue 33): a save a trainer left when it was killed
mid-save is seen and freed. Real daemons, a real trainer process killed with SIGKILL, the CLI as
a subprocess."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from typing import Any

import pytest

from tierckpt_client import DaemonClient

from helpers import DaemonProcess

CLI = [sys.executable, "-m", "tierckpt_client.cli"]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _json(*args: str, env: dict[str, str] | None = None) -> Any:
    proc = _cli(*args, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# A trainer whose save has sealed its files and stops before the commit (finish): where a
# trainer killed mid-save leaves its attempt.
STUCK_TRAINER = """
import sys, time
import torch
import torch.distributed.checkpoint as dcp
from tierckpt_client.dcp import TieredStorageWriter

class StuckBeforeCommit(TieredStorageWriter):
    def finish(self, metadata, results):
        print("sealed", flush=True)
        time.sleep(600)

writer = StuckBeforeCommit(sys.argv[1], int(sys.argv[2]))
dcp.save({"w": torch.ones(1 << 20)}, storage_writer=writer, no_dist=True)
"""


def _start_stuck_trainer(ns: str, step: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_TRAINER, ns, str(step)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 90)  # bound: a torch import on 2 cores
    if not ready or proc.stdout.readline().strip() != "sealed":
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        pytest.fail("the trainer never sealed its save")
    return proc


@pytest.mark.slow
def test_a_save_left_by_a_killed_trainer_is_shown_and_freed(client_env: DaemonProcess) -> None:
    ns, step = "killed", 7
    trainer = _start_stuck_trainer(ns, step)
    try:
        # While the trainer runs, its save is not abandoned: the daemon refuses to free it.
        busy = _cli("rm", ns, str(step), "--abandoned")
        assert busy.returncode == 1, busy
        assert "still runs" in busy.stderr and str(trainer.pid) in busy.stderr
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        assert trainer.stdout is not None
        trainer.stdout.close()

    listing = _cli("ls", ns)
    assert listing.returncode == 0, listing.stderr
    row = listing.stdout.splitlines()[1].split()
    assert row[:2] == [str(step), "writing"]
    assert "its writer is gone; the daemon reclaims it in 1" in listing.stdout  # in 15m
    assert f"tierckpt rm {ns} {step} --abandoned" in listing.stdout

    info = _json("inspect", ns, str(step))
    assert info["state"] == "writing"
    (attempt,) = info["attempts"]
    assert attempt["writer_alive"] is False and attempt["writers"] == [trainer.pid]
    assert attempt["owner"] == f"uid:{os.getuid()}"
    assert attempt["bytes"] >= 4 << 20 and attempt["files"]
    assert 800 < attempt["reclaim_in_s"] <= 900  # TIERCKPT_LEASE_TTL_S
    text = _cli("inspect", ns, str(step)).stdout
    assert attempt["attempt"] in text and "gone (pid" in text

    # rm without --abandoned says what to do; with it, the memory is free now.
    plain = _cli("rm", ns, str(step))
    assert plain.returncode == 3 and "--abandoned" in plain.stderr, plain
    freed = _cli("rm", ns, str(step), "--abandoned")
    assert freed.returncode == 0, freed.stderr
    assert attempt["attempt"] in freed.stdout
    status = DaemonClient.from_socket(client_env.socket).status()
    assert status.leased_bytes == 0
    assert status.pool_bytes >= attempt["bytes"]  # back in the pool, for the next lease
    assert _cli("inspect", ns, str(step)).returncode == 3
