"""A load of "latest" whose newest durable step is corrupt in the persistent tier loads the newest
older step that verifies, on every rank together; an explicit corrupt step fails naming it.

Two ranks (spawn + gloo) on one node, a real daemon persisting to a real S3 bucket (SeaweedFS),
steps 5 and 6 durable, one byte of step 6's largest object flipped, the node's memory wiped. The
trainer reads the tier straight into its tensors (the corruption is found during the read, by one
rank only), or its daemon hydrates the step first (found before the read)."""

from __future__ import annotations

import logging
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tierckpt_client import Checkpointer, IntegrityError, StepStateError
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.layout import read_step_manifest
from tierckpt_core.objectstore import StoreSettings, open_store

from helpers import DaemonProcess, run_ranks
from kit import wait_durable

pytestmark = pytest.mark.slow

WORLD = 2
ROWS = 256  # 256 x 1000 float32, sharded by rows: ~0.5 MB per rank's file, 16 KiB+ blocks


def _full(step: int) -> torch.Tensor:
    return torch.randn(ROWS, 1000, generator=torch.Generator().manual_seed(step))


def _state(step: int, mesh: object, dim: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "w": distribute_tensor(_full(step), mesh, [Shard(dim)]),  # type: ignore[arg-type]
        "b": torch.randn(33, generator=g),
        "extra": {"step": step},
    }


def _empty(mesh: object) -> dict[str, object]:
    return {
        "w": distribute_tensor(torch.zeros(ROWS, 1000), mesh, [Shard(0)]),  # type: ignore[arg-type]
        "b": torch.zeros(33),
        "extra": {"step": -1},
    }


def _assert_step(out: dict[str, object], step: int, mesh: object) -> None:
    ref = _state(step, mesh)
    assert torch.equal(out["w"].to_local(), ref["w"].to_local())  # type: ignore[attr-defined]
    assert torch.equal(out["b"], ref["b"])  # type: ignore[arg-type]
    assert out["extra"] == {"step": step}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _save_worker(rank: int, world: int, socket: str, dims: dict[int, int]) -> None:
    """Steps 5 and 6, "w" sharded along ``dims[step]``."""
    os.environ["TIERCKPT_SOCKET"] = socket
    mesh = init_device_mesh("cpu", (world,))
    for step in (5, 6):
        dcp.save(_state(step, mesh, dims[step]), storage_writer=TieredStorageWriter("job", step))


def _restored(mesh: object) -> tuple[int | None, dict[str, object]]:
    out = _empty(mesh)
    with Checkpointer("job", handle_signals=False) as ckpt:
        return ckpt.restore(out), out


def _load_worker(rank: int, world: int, socket: str, names: list[str], direct: bool) -> None:
    """Latest loads step 5 on every rank, warning about step 6's corrupt file and block; an
    explicit step 6 fails with an IntegrityError naming it."""
    os.environ["TIERCKPT_SOCKET"] = socket
    mesh = init_device_mesh("cpu", (world,))
    seen = _Warnings()
    logging.getLogger("tierckpt_client").addHandler(seen)
    out = _empty(mesh)
    reader = TieredStorageReader("job")
    dcp.load(out, storage_reader=reader)
    assert reader.resolved_step == 5
    _assert_step(out, 5, mesh)
    if rank == 0:  # rank 0 says so (reading straight from S3 every rank does)
        assert any(all(re.search(n, m) for n in names) for m in seen.messages), (
            names,
            seen.messages,
        )
    # Every rank loaded step 5 (none a mix): the same answer from each.
    steps: list[object] = [None] * world
    dist.all_gather_object(steps, (reader.resolved_step, out["extra"]))
    assert steps == [(5, {"step": 5})] * world
    # The Checkpointer's restore falls back the same way and says which step it loaded.
    step, again = _restored(mesh)
    assert step == 5
    _assert_step(again, 5, mesh)

    with pytest.raises(CheckpointException) as err:
        dcp.load(_empty(mesh), storage_reader=TieredStorageReader("job", 6))
    failures = [exc for exc, _ in err.value.failures.values()]
    assert failures, err.value
    for e in failures:
        assert all(re.search(n, str(e)) for n in names), (names, e)
        if direct:  # found while the plan is read: the reader's own error
            assert isinstance(e, IntegrityError), e
        else:  # found by the daemon's hydration in read_metadata, whose errors DCP re-raises
            # as an AssertionError carrying their message
            assert "is corrupt" in str(e), e


def _corrupt_newest(tier_url: str) -> list[str]:
    """Flip one byte in the middle of step 6's largest object (a rank's file: its shard of "w");
    what the warning about it must name (patterns): the step, the file, the block the byte is
    in, the tier."""
    store = open_store(tier_url, StoreSettings.from_env())
    obj = max(store.list("job/step_000000000006/"), key=lambda o: o.size)
    name = obj.key.rsplit("/", 1)[1]
    record = next(f for f in read_step_manifest(store, "job", 6).files if f.name == name)
    assert record.block_size and record.length > 4 * record.block_size
    data = bytearray(store.get_bytes(obj.key))
    at = len(data) // 2
    data[at] ^= 0x01
    store.put_bytes(obj.key, bytes(data))
    return ["step 6", re.escape(name), rf"block {at // record.block_size}\b", re.escape(tier_url)]


def _corrupt_and_wipe(node: DaemonProcess, tier_url: str, dims: dict[int, int]) -> list[str]:
    """Steps 5 and 6 durable, step 6 corrupt in the tier, the node's memory lost."""
    run_ranks(_save_worker, WORLD, str(node.socket), dims)
    wait_durable("job", {5, 6})
    names = _corrupt_newest(tier_url)
    node.kill()
    shutil.rmtree(node.shm_dir)
    node.start()
    return names


def _scenario(
    node: DaemonProcess, tier_url: str, monkeypatch: pytest.MonkeyPatch, *, direct: bool
) -> None:
    names = _corrupt_and_wipe(node, tier_url, {5: 0, 6: 0})
    if direct:
        monkeypatch.setenv("TIERCKPT_PERSIST_URL", tier_url)
        monkeypatch.setenv("TIERCKPT_RESTORE_DIRECT", "on")
    else:  # the trainer does not know the tier: its daemon hydrates
        monkeypatch.delenv("TIERCKPT_PERSIST_URL", raising=False)
    run_ranks(_load_worker, WORLD, str(node.socket), names, direct)


@pytest.mark.parametrize("tier_url", ["s3"], indirect=True)
def test_latest_falls_back_past_a_step_found_corrupt_while_read_from_s3(
    node: DaemonProcess, tier_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer reads S3 straight into its tensors: one rank finds the bad block mid-read,
    and both ranks load step 5 instead."""
    _scenario(node, tier_url, monkeypatch, direct=True)


@pytest.mark.parametrize("tier_url", ["s3"], indirect=True)
def test_latest_falls_back_past_a_step_the_daemon_finds_corrupt(
    node: DaemonProcess, tier_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon hydrates from S3 (the trainer does not read the tier)."""
    _scenario(node, tier_url, monkeypatch, direct=False)


def _resharded_worker(rank: int, world: int, socket: str) -> None:
    """Step 5's "w" is sharded by columns, step 6's (and the destination's) by rows: the plan
    made on step 6 cannot read step 5, so dcp.load fails naming step 5; the Checkpointer's
    restore then loads step 5 with a plan of its own."""
    os.environ["TIERCKPT_SOCKET"] = socket
    mesh = init_device_mesh("cpu", (world,))
    with pytest.raises(CheckpointException) as err:
        dcp.load(_empty(mesh), storage_reader=TieredStorageReader("job"))
    failures = [exc for exc, _ in err.value.failures.values()]
    assert failures and all(isinstance(e, StepStateError) for e in failures), failures
    assert all(getattr(e, "fallback_step", None) == 5 for e in failures), failures
    assert all("step 6 is corrupt" in str(e) and "step 5" in str(e) for e in failures), failures
    step, out = _restored(mesh)
    assert step == 5
    _assert_step(out, 5, mesh)


@pytest.mark.parametrize("tier_url", ["s3"], indirect=True)
def test_latest_falls_back_to_an_older_step_of_another_sharding(
    node: DaemonProcess, tier_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _corrupt_and_wipe(node, tier_url, {5: 1, 6: 0})
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", tier_url)
    monkeypatch.setenv("TIERCKPT_RESTORE_DIRECT", "on")
    run_ranks(_resharded_worker, WORLD, str(node.socket))


def _flat(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ROWS * 1000, generator=g), "extra": {"step": step}}


@pytest.mark.parametrize("tier_url", ["s3"], indirect=True)
def test_one_process_falls_back_and_fails_naming_every_corrupt_step(
    node: DaemonProcess,
    tier_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A load alone (``no_dist``): every step corrupt fails with an IntegrityError naming each;
    with step 5 good again, "latest" loads it."""
    for step in (5, 6):
        dcp.save(_flat(step), storage_writer=TieredStorageWriter("job", step), no_dist=True)
    wait_durable("job", {5, 6})
    store = open_store(tier_url, StoreSettings.from_env())
    obj = max(store.list("job/step_000000000005/"), key=lambda o: o.size)
    good = store.get_bytes(obj.key)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    store.put_bytes(obj.key, bytes(bad))
    _corrupt_newest(tier_url)
    node.kill()
    shutil.rmtree(node.shm_dir)
    node.start()
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", tier_url)
    monkeypatch.setenv("TIERCKPT_RESTORE_DIRECT", "on")

    out = {"w": torch.zeros(ROWS * 1000), "extra": {"step": -1}}
    with pytest.raises(CheckpointException) as err:
        dcp.load(out, storage_reader=TieredStorageReader("job"), no_dist=True)
    (failure, _), *_ = err.value.failures.values()
    assert isinstance(failure, IntegrityError), failure
    assert re.search(r"step 6: .*block \d+.*step 5: .*block \d+", str(failure)), failure

    store.put_bytes(obj.key, good)
    reader = TieredStorageReader("job")
    with caplog.at_level(logging.WARNING, logger="tierckpt_client.dcp.reader"):
        dcp.load(out, storage_reader=reader, no_dist=True)
    assert reader.resolved_step == 5
    assert torch.equal(out["w"], _flat(5)["w"]) and out["extra"] == {"step": 5}  # type: ignore[arg-type]
    assert any("job/step 6 is corrupt" in r.getMessage() for r in caplog.records)
