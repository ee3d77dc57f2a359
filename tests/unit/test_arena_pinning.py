"""Tier files that CUDA copies go through are registered as page-locked memory once, and given back.

CUDA's registration calls are replaced by a recorder on CPU machines (the seam is the two calls);
on a machine with a GPU, the last test saves and restores CUDA tensors for real and checks that
the staged file is pinned.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt_client import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _arena
from tierckpt_client.dcp._staging import stage_into, staging_size

from helpers import DaemonProcess


class Recorder:
    def __init__(self, fail: int = 0) -> None:
        self.registered: dict[int, int] = {}
        self.calls = 0
        self.fail = fail

    def register(self, ptr: int, size: int) -> int:
        self.calls += 1
        if self.fail:
            return self.fail
        assert ptr not in self.registered
        self.registered[ptr] = size
        return 0

    def unregister(self, ptr: int) -> int:
        assert ptr in self.registered, "unregistered memory that was never registered"
        del self.registered[ptr]
        return 0


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    rec = Recorder()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_arena, "_cuda_host_register", rec.register)
    monkeypatch.setattr(_arena, "_cuda_host_unregister", rec.unregister)
    _arena.clear_cache()
    yield rec
    _arena.clear_cache()


@pytest.fixture
def shm_file() -> Iterator[Path]:
    path = Path("/dev/shm") / f"tierckpt-pin-{os.getpid()}"
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    yield path
    path.unlink(missing_ok=True)


def test_a_tier_file_is_registered_once_whole_and_unregistered_when_it_goes(
    cuda: Recorder, shm_file: Path
) -> None:
    m = _arena.map_file(str(shm_file))
    assert _arena.pin(m) and _arena.pin(_arena.map_file(str(shm_file)))
    assert cuda.registered == {m.base: 1 << 20} and cuda.calls == 1  # once per mapping
    view = m.view(4096, 64)
    assert _arena.pin_holding(view) and cuda.calls == 1  # found through any tensor inside it
    # The daemon deletes the file (evicted, pool trimmed): the next mapping drops and unpins it.
    shm_file.unlink()
    other = shm_file.with_name(shm_file.name + "-b")
    other.write_bytes(b"\0" * 4096)
    try:
        _arena.map_file(str(other))
        assert cuda.registered == {} and not m.pinned
    finally:
        other.unlink()


def test_a_failed_registration_is_reported_once_and_the_copy_still_works(
    monkeypatch: pytest.MonkeyPatch, shm_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder(fail=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_arena, "_cuda_host_register", rec.register)
    _arena.clear_cache()
    try:
        m = _arena.map_file(str(shm_file))
        with caplog.at_level(logging.WARNING, logger=_arena.__name__):
            assert not _arena.pin(m) and not _arena.pin(m)
        assert rec.calls == 1
        assert "cudaHostRegister error 2" in caplog.text and "TIERCKPT_PIN_MEMORY=0" in caplog.text
        sd = {"w": torch.arange(100, dtype=torch.float32)}
        staged = stage_into(sd, m).state_dict
        assert torch.equal(staged["w"], sd["w"])
    finally:
        _arena.clear_cache()


def test_only_mappings_of_the_cache_are_pinned_and_cpu_saves_pin_nothing(
    cuda: Recorder, shm_file: Path
) -> None:
    private = _arena.FileMapping(-1, -1, -1, 4096, torch.empty(4096, dtype=torch.uint8))
    assert not _arena.pin(private)  # nothing would ever unregister it
    assert not _arena.pin_holding(torch.ones(10))  # not in a tier file
    sd = {"w": torch.ones(1000), "b": [torch.zeros(3)]}
    assert staging_size(sd) <= 1 << 20
    stage_into(sd, _arena.map_file(str(shm_file)))
    assert cuda.calls == 0  # CPU tensors: no device copy, nothing to pin


def test_pin_memory_setting() -> None:
    assert ClientConfig.from_env({}).pin_memory
    assert not ClientConfig.from_env({"TIERCKPT_PIN_MEMORY": "0"}).pin_memory
    with pytest.raises(ValueError, match="TIERCKPT_PIN_MEMORY='maybe' is not 0 or 1"):
        ClientConfig.from_env({"TIERCKPT_PIN_MEMORY": "maybe"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_stage_into_a_pinned_tier_file_and_restore_bit_exact(
    daemon: DaemonProcess,
) -> None:
    cfg = ClientConfig.from_env(socket=daemon.socket)
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {"w": torch.randn(1 << 20, device="cuda", generator=g), "step": 3}
    _arena.clear_cache()
    dcp.save(state, storage_writer=TieredStorageWriter("gpu", 1, config=cfg), no_dist=True)
    assert any(m.pinned for m in _arena._by_base)  # the staged file
    out = {"w": torch.zeros(1 << 20, device="cuda"), "step": -1}
    dcp.load(out, storage_reader=TieredStorageReader("gpu", 1, config=cfg), no_dist=True)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3
