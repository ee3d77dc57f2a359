"""A restore of a step that is in no node's memory, read by the trainer straight from the
persistent tier into its tensors (``TIERCKPT_PERSIST_URL`` set in the trainer), verified block by
block; the daemon brings the step into memory afterwards, so the next restore is local."""

from __future__ import annotations

import logging
import shutil
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.objectstore import StoreSettings, open_store

from helpers import DaemonProcess
from kit import seeded_state, wait_durable

pytestmark = pytest.mark.slow

# Sizes that do not fall on block boundaries (16 KiB blocks in a file this small), so that
# tensors share blocks with their neighbours and with the padding between them.
N = 70_001


# What each step saves: kit.seeded_state(step, **LAYOUT).
LAYOUT: dict[str, Any] = {
    "numel": N,
    "more": {
        "b": ((33,), torch.float32),
        "h": ((3, 1000), torch.float16),
        "i": ((4097,), torch.int64),
    },
    "note": "x" * 5000,
}


def _empty() -> dict[str, object]:
    return {
        "w": torch.zeros(N),
        "b": torch.zeros(33),
        # read into another dtype: not a plain copy of bytes (a private buffer, then converted)
        "h": torch.zeros(3, 1000, dtype=torch.float32),
        "i": torch.zeros(4097, dtype=torch.int64),
        "meta": {"step": -1, "note": ""},
    }


def _assert_state(out: dict[str, object], step: int) -> None:
    ref = seeded_state(step, **LAYOUT)
    for k in ("w", "b", "i"):
        assert torch.equal(out[k], ref[k]), k  # type: ignore[arg-type]
    assert torch.equal(out["h"], ref["h"].to(torch.float32))  # type: ignore[union-attr]
    assert out["meta"] == ref["meta"]


def _in_memory(ns: str, step: int) -> bool:
    with DaemonClient() as c:
        return any(x.step == step and x.in_memory for x in c.candidates(ns))


def _saved_and_wiped(node: DaemonProcess, tier_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 7 durable, then the node loses its memory; the trainer knows the persistent tier
    (on for file:// too: the default reads S3 tiers directly)."""
    dcp.save(seeded_state(7, **LAYOUT), storage_writer=TieredStorageWriter("job", 7), no_dist=True)
    wait_durable("job", 7)
    node.kill()
    shutil.rmtree(node.shm_dir)
    node.start()
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", tier_url)
    monkeypatch.setenv("TIERCKPT_RESTORE_DIRECT", "on")


def test_restore_reads_the_tier_into_the_tensors_and_the_next_comes_from_memory(
    node: DaemonProcess,
    tier_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _saved_and_wiped(node, tier_url, monkeypatch)
    out = _empty()
    reader = TieredStorageReader("job")  # "latest": the durable step, in no node's memory
    with caplog.at_level(logging.INFO, logger="tierckpt_client.dcp.reader"):
        dcp.load(out, storage_reader=reader, no_dist=True)
    assert reader.resolved_step == 7
    _assert_state(out, 7)
    assert any("reading it straight from" in r.getMessage() for r in caplog.records)
    # The daemon fills its memory after the load, without the load waiting for it.
    fill = reader.memory_fill
    assert fill is not None
    fill.join(timeout=60)
    assert not fill.is_alive()
    assert _in_memory("job", 7)

    again = _empty()
    reader = TieredStorageReader("job", 7)
    dcp.load(again, storage_reader=reader, no_dist=True)
    _assert_state(again, 7)
    assert reader.memory_fill is None  # served from this node's memory, not the tier


def test_a_flipped_byte_in_the_tier_fails_the_restore_naming_the_block(
    node: DaemonProcess, tier_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved_and_wiped(node, tier_url, monkeypatch)
    store = open_store(tier_url, StoreSettings.from_env())
    objects = store.list("job/step_000000000007/")
    key = max(objects, key=lambda o: o.size).key  # the rank's file, holding "w"
    data = bytearray(store.get_bytes(key))
    at = 40_000 * 4 + 3  # inside tensor "w", block 9 of 16 KiB blocks
    data[at] ^= 0x01
    store.put_bytes(key, bytes(data))
    out = _empty()
    reader = TieredStorageReader("job", 7)
    with pytest.raises(CheckpointException) as err:
        dcp.load(out, storage_reader=reader, no_dist=True)
    text = str(err.value)
    assert "does not match the checksum taken when it was written" in text
    assert f"block {at // (16 << 10)}," in text and key.rsplit("/", 1)[1] in text
    assert reader.memory_fill is None  # nothing is brought into memory from a corrupt step
    assert not _in_memory("job", 7)


def test_without_access_from_the_trainer_the_daemon_hydrates_first(
    node: DaemonProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer's URL points where it cannot read (only the daemon can): today's path."""
    _saved_and_wiped(node, "file:///nonexistent-tier", monkeypatch)
    out = _empty()
    reader = TieredStorageReader("job", 7)
    with caplog.at_level(logging.WARNING, logger="tierckpt_client.dcp.reader"):
        dcp.load(out, storage_reader=reader, no_dist=True)
    _assert_state(out, 7)
    assert reader.memory_fill is None
    assert _in_memory("job", 7)
    assert any(
        "cannot read the persistent tier" in r.getMessage() and "daemon brings" in r.getMessage()
        for r in caplog.records
    )
