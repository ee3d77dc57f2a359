"""The memory tier across daemon restarts, capacity limits, retention, and the errors users see."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client import (
    CapacityExceededError,
    ClientConfig,
    DaemonClient,
    DaemonUnavailableError,
    InvalidNameError,
)
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import DaemonProcess
from kit import blank_state, load, save, seeded_state

N = 4096


def _interrupted_save(socket: str, ns: str, step: int) -> None:
    """A trainer that dies after every rank wrote its files but before the commit."""
    os.environ["TIERCKPT_SOCKET"] = socket

    class DiesBeforeCommit(TieredStorageWriter):
        def finish(self, metadata, results):  # type: ignore[no-untyped-def]
            os._exit(17)

    dcp.save(seeded_state(step, N), storage_writer=DiesBeforeCommit(ns, step), no_dist=True)


def test_committed_steps_survive_sigkill_and_partial_save_is_reclaimed(
    client_env: DaemonProcess,
) -> None:
    daemon = client_env
    save("job", 10, seeded_state(10, N), staged=False)
    save("job", 20, seeded_state(20, N), staged=False)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_interrupted_save, args=(str(daemon.socket), "job", 30))
    p.start()
    p.join(60)
    assert p.exitcode == 17
    with DaemonClient() as c:
        assert [(s.step, s.state.value) for s in c.steps("job")][-1] == (30, "writing")

    daemon.kill(signal.SIGKILL)
    daemon.start()

    step, out = load("job", blank_state(N))
    assert step == 20  # the interrupted step 30 is never "latest"
    assert torch.equal(out["w"], seeded_state(20, N)["w"]) and out["meta"] == {"step": 20}
    step, out = load("job", blank_state(N), 10)
    assert torch.equal(out["w"], seeded_state(10, N)["w"])
    with DaemonClient() as c:
        assert [(s.step, s.state.value) for s in c.steps("job")] == [
            (10, "committed"),
            (20, "committed"),
        ]
        status = c.status()
    # Step 30's files went back to the pool for reuse; nothing of it is left in the namespace.
    assert status.pool_files >= 1
    assert not any("000000000030" in p.name for p in (daemon.shm_dir / "ns" / "job").iterdir())
    assert not any((daemon.shm_dir / "leases").iterdir())


@pytest.mark.daemon_settings(keep_last=2)
def test_keep_last_and_files_are_recycled(client_env: DaemonProcess) -> None:
    inodes: dict[int, set[int]] = {}
    with DaemonClient() as c:
        for step in (1, 2, 3, 4):
            save("keep", step, seeded_state(step, 1 << 16))
            pin = c.pin("keep", step)
            inodes[step] = {os.stat(p).st_ino for n, p in pin.paths.items() if n.endswith(".data")}
            c.unpin("keep", step, pin.pin_id)
        assert [s.step for s in c.steps("keep")] == [3, 4]
    # Committing step 3 evicted step 1 into the pool, so step 4's lease took step 1's file back:
    # the same inode, whose pages are already allocated (and mapped in this process).
    assert all(inodes.values())
    assert inodes[4] == inodes[1]
    step, out = load("keep", blank_state(1 << 16))
    assert step == 4 and torch.equal(out["w"], seeded_state(4, 1 << 16)["w"])


@pytest.mark.daemon_settings(capacity="1M", keep_last=1)
def test_over_capacity_save_fails_with_clear_error_and_keeps_last_step(
    client_env: DaemonProcess,
) -> None:
    save("cap", 1, seeded_state(1, 1024), staged=False)
    with pytest.raises(
        CapacityExceededError, match=r"namespace cap: a lease of \d+ bytes does not fit"
    ):
        # async_save stages in the caller: the daemon's error surfaces directly.
        dcp.async_save(
            seeded_state(2, 1 << 19), storage_writer=TieredStorageWriter("cap", 2), no_dist=True
        )
    with pytest.raises(CheckpointException, match="does not fit in the memory tier"):
        # plain save: DCP wraps write_data's error
        save("cap", 3, seeded_state(3, 1 << 19), staged=False)
    step, out = load("cap", blank_state(1024))
    assert step == 1 and torch.equal(out["w"], seeded_state(1, 1024)["w"])


def test_daemon_unreachable_is_a_clear_error(tmp_path: object) -> None:
    cfg = ClientConfig(socket="/nonexistent/tierckpt.sock", connect_timeout_s=1.0)  # type: ignore[arg-type]
    writer = TieredStorageWriter("job", 1, config=cfg)
    with pytest.raises(
        DaemonUnavailableError, match="cannot reach the tierckpt daemon at /nonexistent"
    ):
        dcp.async_save(seeded_state(1, N), storage_writer=writer, no_dist=True)


def test_invalid_names_are_rejected_before_anything_is_written() -> None:
    with pytest.raises(InvalidNameError, match=re.escape("namespace '../etc'")):
        TieredStorageWriter("../etc", 1)
    with pytest.raises(InvalidNameError, match="step -3 is out of range"):
        TieredStorageWriter("job", -3)
    with pytest.raises(InvalidNameError, match="not a tierckpt id"):
        TieredStorageReader().reset("s3://bucket/x")


def test_missing_namespace_and_step_name_what_is_missing(client_env: DaemonProcess) -> None:
    with pytest.raises(CheckpointException, match=r"namespace nope has no committed step"):
        load("nope", blank_state(N))
    save("have", 5, seeded_state(5, N), staged=False)
    with pytest.raises(
        CheckpointException, match=r"have/step 6 is not committed in memory \(committed: \[5\]\)"
    ):
        load("have", blank_state(N), 6)


def test_checkpoint_id_form(client_env: DaemonProcess) -> None:
    dcp.save(
        seeded_state(7, N),
        checkpoint_id="tierckpt://ids/7",
        storage_writer=TieredStorageWriter(),
        no_dist=True,
    )
    out = blank_state(N)
    dcp.load(
        out, checkpoint_id="tierckpt://ids/7", storage_reader=TieredStorageReader(), no_dist=True
    )
    assert torch.equal(out["w"], seeded_state(7, N)["w"])
