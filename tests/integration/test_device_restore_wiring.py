"""The restore into CUDA tensors (``dcp/_device_copy``) on a machine without CUDA: the streams are
recorded instead of made, and host tensors stand in for device ones, so the load goes the device
path through a real daemon and reader (tests/integration/test_cuda_paths.py runs it on a GPU).
What a user would see: the bytes land exact, every block read is checked before the load
returns, the copies' streams are synchronized whatever happened, and a bad block fails the load
or, for "latest", falls back to the older step."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _device_copy
from tierckpt_client.dcp.sources import files
from tierckpt_core import verified_copy
from tierckpt_core.errors import BlockMismatchError

from helpers import DaemonProcess
from kit import flip_byte, step_paths

N = 3 << 20


class _Stream:
    def __init__(self, device: int | None = None) -> None:
        self.waited: list[Any] = []
        self.synced = 0

    def wait_stream(self, other: Any) -> None:
        self.waited.append(other)

    def synchronize(self) -> None:
        self.synced += 1


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, _Stream]]:
    """Host tensors taken as device destinations; CUDA's stream calls recorded."""
    streams: dict[int, _Stream] = {}
    monkeypatch.setattr(_device_copy, "_STREAMS", streams)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(
        files,
        "takes_bytes",
        lambda t, n: t.is_contiguous() and t.numel() * t.element_size() == n,
    )
    yield streams


def _state(seed: int, n: int = N) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, generator=g), "b": torch.randn(999, generator=g), "n": seed}


def _blank(n: int = N) -> dict[str, Any]:
    return {"a": torch.zeros(n), "b": torch.zeros(999), "n": -1}


def test_device_restore_lands_exact_checks_and_falls_back(
    client_env: DaemonProcess, device_path: dict[int, _Stream]
) -> None:
    old, new = _state(1), _state(2)
    for step, sd in ((1, old), (2, new)):
        dcp.async_save(sd, storage_writer=TieredStorageWriter("dev", step), no_dist=True).result()
    out = _blank()
    dcp.load(out, storage_reader=TieredStorageReader("dev", 2), no_dist=True)
    assert torch.equal(out["a"], new["a"]) and torch.equal(out["b"], new["b"]) and out["n"] == 2
    (side,) = device_path.values()
    assert side.waited == ["current"] and side.synced == 1  # after the loop's work; done before

    data = next(p for name, p in step_paths("dev", 2).items() if name.endswith(".data"))
    flip_byte(data, 5 << 20)
    with pytest.raises(CheckpointException) as e:
        dcp.load(_blank(), storage_reader=TieredStorageReader("dev", 2), no_dist=True)
    ((err, _),) = e.value.failures.values()
    assert isinstance(err, BlockMismatchError) and err.file is not None
    assert side.synced == 2  # synchronized on the way out of the failure too
    out = _blank()
    r = TieredStorageReader("dev")
    dcp.load(out, storage_reader=r, no_dist=True)
    assert r.resolved_step == 1
    assert torch.equal(out["a"], old["a"]) and torch.equal(out["b"], old["b"]) and out["n"] == 1


@pytest.mark.parametrize(
    ("n", "helpers"),
    [(N, True), (1 << 19, False)],  # 12 MiB: blocks of 256 KiB; 2 MiB: blocks of 64 KiB
)
def test_blocks_hashed_under_the_gil_are_checked_on_the_loads_thread_alone(
    client_env: DaemonProcess,
    device_path: dict[int, _Stream],
    monkeypatch: pytest.MonkeyPatch,
    n: int,
    helpers: bool,
) -> None:
    """Blocks no larger than xxhash hashes under the GIL (64 KiB: files under 8 MiB) are checked
    on the load's thread alone: helpers could only hand the GIL around (the same hash through
    ctypes was slower over 4 and 16 threads than one). Larger blocks (every file of 8 MiB or
    more) are shared with helpers, which hash them at once. Every block is checked either way:
    a flipped byte fails the load."""
    woken: list[int] = []
    real = _device_copy.on_helpers
    monkeypatch.setattr(
        _device_copy, "on_helpers", lambda kind, k, fn: woken.append(k) or real(kind, k, fn)
    )
    monkeypatch.setattr(verified_copy, "PARALLEL_MIN", 1 << 20)  # several runs of blocks
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    ns = f"blocks{n}"
    sd = _state(3, n)
    for step in (1, 2):
        dcp.async_save(sd, storage_writer=TieredStorageWriter(ns, step), no_dist=True).result()
    data = {
        step: next(p for name, p in step_paths(ns, step).items() if name.endswith(".data"))
        for step in (1, 2)
    }

    def load_and_flip(step: int) -> list[int]:
        woken.clear()
        out = _blank(n)
        dcp.load(out, storage_reader=TieredStorageReader(ns, step), no_dist=True)
        assert torch.equal(out["a"], sd["a"])
        flip_byte(data[step], n * 4 * 5 // 6)
        with pytest.raises(CheckpointException) as e:
            dcp.load(_blank(n), storage_reader=TieredStorageReader(ns, step), no_dist=True)
        ((err, _),) = e.value.failures.values()
        assert isinstance(err, BlockMismatchError)
        return woken

    for step in (1, 2):
        assert bool(load_and_flip(step)) is helpers


def test_the_benchmarks_restore_phases_add_up(
    client_env: DaemonProcess, device_path: dict[int, _Stream]
) -> None:
    """bench/gpu_staging.py's phase breakdown of a restore (run on a GPU only) measures this
    path: the load's mapping is the writer's (no new mapping, no registration), and the phases
    are there and within the load's time."""
    spec = importlib.util.spec_from_file_location(
        "_restore_phases", Path(__file__).parents[2] / "bench" / "_restore_phases.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dcp.async_save(_state(4), storage_writer=TieredStorageWriter("ph", 1), no_dist=True).result()
    phases = module.RestorePhases().install()
    try:
        with phases.measure() as ph:
            dcp.load(_blank(), storage_reader=TieredStorageReader("ph", 1), no_dist=True)
    finally:
        phases.uninstall()
    assert ph["new_mappings"] == 0 and ph["registrations"] == 0
    assert ph["metadata"] > 0 and ph["open"] > 0 and ph["verify"] > 0 and ph["close"] > 0
    assert ph["device"] >= ph["verify"] + ph["sync"]
    parts = ("metadata", "open", "map", "device", "close", "rest")
    assert sum(ph[k] for k in parts) == pytest.approx(ph["total"])
    assert TieredStorageReader.read_metadata.__name__ == "read_metadata"  # unwrapped again
    s = module.summary([ph, ph])
    assert s["new_mappings"] == [0, 0] and "verify" in module.line(s)
