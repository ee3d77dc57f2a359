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


def _state(step: int, n: int = 4096) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "meta": {"step": step}}


def _empty(n: int = 4096) -> dict[str, object]:
    return {"w": torch.zeros(n), "meta": {"step": -1}}


def _save(ns: str, step: int, n: int = 4096, *, staged: bool = False) -> None:
    writer = TieredStorageWriter(ns, step)
    if staged:  # async_save: stage() copies into the leased .data file
        dcp.async_save(_state(step, n), storage_writer=writer, no_dist=True).result()
    else:  # plain save: write_data copies into the .extra file
        dcp.save(_state(step, n), storage_writer=writer, no_dist=True)


def _load(ns: str, step: int | None = None, n: int = 4096) -> tuple[int | None, dict[str, object]]:
    out = _empty(n)
    reader = TieredStorageReader(ns, step)
    dcp.load(out, storage_reader=reader, no_dist=True)
    return reader.resolved_step, out


def _interrupted_save(socket: str, ns: str, step: int) -> None:
    """A trainer that dies after every rank wrote its files but before the commit."""
    os.environ["TIERCKPT_SOCKET"] = socket

    class DiesBeforeCommit(TieredStorageWriter):
        def finish(self, metadata, results):  # type: ignore[no-untyped-def]
            os._exit(17)

    dcp.save(_state(step), storage_writer=DiesBeforeCommit(ns, step), no_dist=True)


def test_committed_steps_survive_sigkill_and_partial_save_is_reclaimed(
    client_env: DaemonProcess,
) -> None:
    daemon = client_env
    _save("job", 10)
    _save("job", 20)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_interrupted_save, args=(str(daemon.socket), "job", 30))
    p.start()
    p.join(60)
    assert p.exitcode == 17
    with DaemonClient() as c:
        assert [(s.step, s.state.value) for s in c.steps("job")][-1] == (30, "writing")

    daemon.kill(signal.SIGKILL)
    daemon.start()

    step, out = _load("job")
    assert step == 20  # the interrupted step 30 is never "latest"
    assert torch.equal(out["w"], _state(20)["w"]) and out["meta"] == {"step": 20}
    step, out = _load("job", 10)
    assert torch.equal(out["w"], _state(10)["w"])
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
            _save("keep", step, n=1 << 16, staged=True)
            pin = c.pin("keep", step)
            inodes[step] = {os.stat(p).st_ino for n, p in pin.paths.items() if n.endswith(".data")}
            c.unpin("keep", step, pin.pin_id)
        assert [s.step for s in c.steps("keep")] == [3, 4]
    # Committing step 3 evicted step 1 into the pool, so step 4's lease took step 1's file back:
    # the same inode, whose pages are already allocated (and mapped in this process).
    assert all(inodes.values())
    assert inodes[4] == inodes[1]
    step, out = _load("keep", n=1 << 16)
    assert step == 4 and torch.equal(out["w"], _state(4, 1 << 16)["w"])


@pytest.mark.daemon_settings(capacity="1M", keep_last=1)
def test_over_capacity_save_fails_with_clear_error_and_keeps_last_step(
    client_env: DaemonProcess,
) -> None:
    _save("cap", 1, n=1024)
    with pytest.raises(
        CapacityExceededError, match=r"namespace cap: a lease of \d+ bytes does not fit"
    ):
        # async_save stages in the caller: the daemon's error surfaces directly.
        dcp.async_save(
            _state(2, n=1 << 19), storage_writer=TieredStorageWriter("cap", 2), no_dist=True
        )
    with pytest.raises(CheckpointException, match="does not fit in the memory tier"):
        _save("cap", 3, n=1 << 19)  # plain save: DCP wraps write_data's error
    step, out = _load("cap", n=1024)
    assert step == 1 and torch.equal(out["w"], _state(1, 1024)["w"])


def test_daemon_unreachable_is_a_clear_error(tmp_path: object) -> None:
    cfg = ClientConfig(socket="/nonexistent/tierckpt.sock", connect_timeout_s=1.0)  # type: ignore[arg-type]
    writer = TieredStorageWriter("job", 1, config=cfg)
    with pytest.raises(
        DaemonUnavailableError, match="cannot reach the tierckpt daemon at /nonexistent"
    ):
        dcp.async_save(_state(1), storage_writer=writer, no_dist=True)


def test_invalid_names_are_rejected_before_anything_is_written() -> None:
    with pytest.raises(InvalidNameError, match=re.escape("namespace '../etc'")):
        TieredStorageWriter("../etc", 1)
    with pytest.raises(InvalidNameError, match="step -3 is out of range"):
        TieredStorageWriter("job", -3)
    with pytest.raises(InvalidNameError, match="not a tierckpt id"):
        TieredStorageReader().reset("s3://bucket/x")


def test_missing_namespace_and_step_name_what_is_missing(client_env: DaemonProcess) -> None:
    with pytest.raises(CheckpointException, match=r"namespace nope has no committed step"):
        _load("nope")
    _save("have", 5)
    with pytest.raises(
        CheckpointException, match=r"have/step 6 is not committed in memory \(committed: \[5\]\)"
    ):
        _load("have", 6)


def test_checkpoint_id_form(client_env: DaemonProcess) -> None:
    dcp.save(
        _state(7),
        checkpoint_id="tierckpt://ids/7",
        storage_writer=TieredStorageWriter(),
        no_dist=True,
    )
    out = _empty()
    dcp.load(
        out, checkpoint_id="tierckpt://ids/7", storage_reader=TieredStorageReader(), no_dist=True
    )
    assert torch.equal(out["w"], _state(7)["w"])
