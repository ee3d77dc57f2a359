"""Python's cyclic collector is paused while tierckpt stages, reads and (Checkpointer) saves and
loads, and given back as it was: with thousands of tensors its collections were a large part of
the stall and of a restore (docs/benchmarks.md, "Thousands of tensors")."""

from __future__ import annotations

import gc
import os
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client import Checkpointer, _gc_pause
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import DaemonProcess

THREAD = AsyncCheckpointerType.THREAD
SEEN: list[tuple[str, bool]] = []  # (where, gc.isenabled()) as the probes found it


class Probe:
    """A non-tensor value: copied in a stage (``__deepcopy__``), unpickled in a load."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __deepcopy__(self, memo: dict[int, Any]) -> Probe:
        SEEN.append(("stage", gc.isenabled()))
        return Probe(self.tag)

    def __setstate__(self, state: dict[str, Any]) -> None:
        SEEN.append(("load", gc.isenabled()))
        self.__dict__.update(state)


@pytest.fixture(autouse=True)
def collector_on() -> Any:
    was = gc.isenabled()
    gc.enable()
    SEEN.clear()
    yield
    if not was:
        gc.disable()


def _state() -> dict[str, Any]:
    return {"model": {f"w{i}": torch.full((100,), float(i)) for i in range(50)}, "p": Probe("x")}


@pytest.mark.parametrize("pause", [True, False])
def test_a_stage_and_a_read_run_with_the_collector_paused_and_give_it_back(
    client_env: DaemonProcess, pause: bool
) -> None:
    config = ClientConfig.from_env(pause_gc=pause)
    sd = _state()
    writer = TieredStorageWriter("gcp", step=1, config=config)
    dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=THREAD, no_dist=True).result(
        timeout=60
    )
    assert gc.isenabled()
    dst = {"model": {k: torch.zeros(100) for k in sd["model"]}, "p": Probe("y")}
    dcp.load(dst, storage_reader=TieredStorageReader("gcp", step=1, config=config), no_dist=True)
    assert gc.isenabled()
    assert dst["p"].tag == "x"
    assert all(torch.equal(dst["model"][k], v) for k, v in sd["model"].items())
    assert [("stage", not pause), ("load", not pause)] == SEEN


def test_the_checkpointer_saves_and_restores_with_the_collector_paused(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP's planning of the background save runs paused; its commit (which may wait for
    # replicas, or a degraded save's upload) does not.
    for owner, name, where in (
        (DefaultSavePlanner, "create_local_plan", "plan"),
        (TieredStorageWriter, "finish", "commit"),
    ):
        real = getattr(owner, name)

        def seen(*args: Any, _real: Any = real, _where: str = where, **kwargs: Any) -> Any:
            SEEN.append((_where, gc.isenabled()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, seen)
    sd = _state()
    with Checkpointer("gcc", async_staging=False, handle_signals=False) as ckpt:
        ckpt.save(1, sd)
        ckpt.wait()
        assert ("plan", False) in SEEN and ("commit", True) in SEEN
        SEEN[:] = [x for x in SEEN if x[0] not in ("plan", "commit")]
        assert gc.isenabled()
        dst = {"model": {k: torch.zeros(100) for k in sd["model"]}, "p": Probe("y")}
        assert ckpt.restore(dst) == 1
    assert gc.isenabled()
    assert ("stage", False) in SEEN and ("load", False) in SEEN
    assert all(on is False for _, on in SEEN)
    assert all(torch.equal(dst["model"][k], v) for k, v in sd["model"].items())


def test_a_collector_the_user_disabled_stays_disabled() -> None:
    gc.disable()
    with _gc_pause.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
    gc.enable()
    with _gc_pause.paused(False):
        assert gc.isenabled()


def test_overlapping_pauses_in_two_threads_end_with_the_last() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with _gc_pause.paused():
            inside.set()
            assert leave.wait(10)

    t = threading.Thread(target=other)
    with _gc_pause.paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause still runs
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_a_child_forked_during_a_pause_has_the_collector_on() -> None:
    r, w = os.pipe()
    with _gc_pause.paused(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (fork with threads, 3.12+)
        pid = os.fork()
        if pid == 0:  # the child: report, and leave at once
            os.write(w, b"1" if gc.isenabled() else b"0")
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1"
    assert gc.isenabled()
