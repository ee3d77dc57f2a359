"""Asynchronous staging (``TieredStorageWriter(async_staging=True)``): ``async_save`` returns an
``AsyncSaveResponse`` at once; a value changed after ``staging_completion`` never reaches the
step; one changed before it fails that save (never a torn step), and with ``Checkpointer`` an
optimizer step waits for the stage by itself. THREAD and PROCESS modes, one rank and FSDP2."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from tierckpt_client import Checkpointer, SaveFailedError
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _async_staging
from tierckpt_client.dcp._helpers import on_helpers
from tierckpt_core.errors import StagingRaceError

from helpers import DaemonProcess, run_ranks


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(3 << 20, generator=g),  # 12 MiB: copied in runs by several threads
        "b": torch.randn(1000, generator=g).to(torch.bfloat16),
        "n": {"step": 5},
    }


def _blank() -> dict[str, Any]:
    return {
        "w": torch.zeros(3 << 20),
        "b": torch.zeros(1000, dtype=torch.bfloat16),
        "n": {"step": -1},
    }


@contextlib.contextmanager
def _held() -> Iterator[threading.Event]:
    """The asynchronous stager's thread kept busy until the event is set: a stage asked for
    meanwhile has not started (a slow copy, made deterministic)."""
    go = threading.Event()
    started = threading.Event()

    def hold() -> None:
        started.set()
        assert go.wait(60)

    on_helpers(_async_staging.ASYNC, 1, hold)
    assert started.wait(10)
    try:
        yield go
    finally:
        go.set()


@pytest.fixture
def held() -> Iterator[threading.Event]:
    with _held() as go:
        yield go


def _change_after_staging_completion(ns: str, kind: AsyncCheckpointerType) -> None:
    sd = _state()
    want = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    res = dcp.async_save(
        sd,
        storage_writer=TieredStorageWriter(ns, 1, async_staging=True),
        async_checkpointer_type=kind,
    )
    assert isinstance(res, AsyncSaveResponse)
    res.staging_completion.result(timeout=60)
    sd["w"].add_(1)  # the loop's optimizer step, once the stage is done
    sd["b"].mul_(3)
    sd["n"]["step"] = 6
    res.upload_completion.result(timeout=120)
    out = _blank()
    dcp.load(out, storage_reader=TieredStorageReader(ns, 1))
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    assert out["n"] == {"step": 5}


def _change_before_staging_completion(ns: str, kind: AsyncCheckpointerType) -> None:
    sd = _state()
    dcp.async_save(sd, storage_writer=TieredStorageWriter(ns, 1)).result(timeout=120)
    with _held():
        res = dcp.async_save(
            sd,
            storage_writer=TieredStorageWriter(ns, 2, async_staging=True),
            async_checkpointer_type=kind,
        )
        assert isinstance(res, AsyncSaveResponse)
        assert not res.staging_completion.done()  # returned before the copy even started
        sd["w"].add_(1)  # the loop did not wait for staging_completion
    with pytest.raises(CheckpointException) as e:
        res.upload_completion.result(timeout=120)
    ((err, _),) = e.value.failures.values()
    assert isinstance(err, StagingRaceError) and "w changed in place" in str(err)
    out = _blank()
    r = TieredStorageReader(ns)
    dcp.load(out, storage_reader=r)
    assert r.resolved_step == 1  # the torn step 2 was never committed


def _process_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    _change_after_staging_completion("zoc-p1", AsyncCheckpointerType.PROCESS)
    _change_before_staging_completion("zoc-p2", AsyncCheckpointerType.PROCESS)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A gloo group of one in this process (THREAD mode, as a trainer's)."""
    from helpers import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_thread_mode_snapshot_rule(client_env: DaemonProcess, one_rank: None) -> None:
    _change_after_staging_completion("zoc-t1", AsyncCheckpointerType.THREAD)
    _change_before_staging_completion("zoc-t2", AsyncCheckpointerType.THREAD)


@pytest.mark.slow
def test_process_mode_snapshot_rule(daemon: DaemonProcess) -> None:
    run_ranks(_process_worker, 1, str(daemon.socket))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(512, 512)


def test_checkpointer_optimizer_step_waits_for_the_stage(
    client_env: DaemonProcess, held: threading.Event
) -> None:
    model = _Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.lin(torch.ones(2, 512)).sum().backward()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer("zoc-ck", handle_signals=False, async_staging=True) as ckpt:
        ckpt.save(1, {"model": model})  # returns at once: the stage is held
        threading.Timer(0.3, held.set).start()
        opt.step()  # waits for the stage, then changes the parameters
        assert not torch.equal(model.lin.weight, want["lin.weight"])
        ckpt.wait()  # no SaveFailedError: the stage saw the values before the step
        restored = _Model()
        for p in restored.parameters():
            p.data.zero_()
        assert ckpt.restore({"model": restored}) == 1
    for k, v in restored.state_dict().items():
        assert torch.equal(v, want[k]), k


class _BNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.bn = nn.BatchNorm1d(64)


class _AppState:
    """A ``Stateful`` wrapper as torch's DCP tutorial writes one: the module one attribute deep."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])


@pytest.mark.parametrize("wrapped", [False, True], ids=["module", "stateful-wrapper"])
def test_checkpointer_a_forward_that_updates_buffers_needs_no_wait(
    client_env: DaemonProcess, held: threading.Event, wrapped: bool
) -> None:
    """BatchNorm's forward in training mode changes its running statistics in place, before
    any optimizer step: ``save`` copies such buffers itself, so the forward right after it
    neither fails the save nor reaches the step."""
    model = _BNModel()
    model.bn(model.lin(torch.randn(8, 64)))  # running stats away from their initial values
    want = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"app": _AppState(model)} if wrapped else {"model": model}
    with Checkpointer(f"zoc-bn-{wrapped}", handle_signals=False, async_staging=True) as ckpt:
        ckpt.save(1, state)  # returns at once: the stage is held
        model.bn(model.lin(torch.randn(8, 64)))  # the next step's forward, no wait
        assert not torch.equal(model.bn.running_mean, want["bn.running_mean"])
        held.set()
        ckpt.wait()  # no SaveFailedError (StagingRaceError) for the buffers
        restored = _BNModel()
        rstate = {"app": _AppState(restored)} if wrapped else {"model": restored}
        assert ckpt.restore(rstate) == 1
    for k, v in restored.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_checkpointer_wait_staged_before_a_change_outside_the_optimizer(
    client_env: DaemonProcess, held: threading.Event
) -> None:
    w = torch.ones(1 << 20)
    with Checkpointer("zoc-ck2", handle_signals=False, async_staging=True) as ckpt:
        ckpt.save(1, {"w": w})
        threading.Timer(0.2, held.set).start()
        ckpt.wait_staged()
        w.add_(1)
        ckpt.save(2, {"w": w})  # waits for step 1's save; raises nothing
        ckpt.wait_staged()
        w.add_(1)  # after the stage: changes nothing in step 2
        with _held():
            ckpt.save(3, {"w": w})
            w.add_(1)  # not waited for: step 3 fails, and the next save says so
        with pytest.raises(SaveFailedError, match="changed in place"):
            ckpt.wait()
    out = {"w": torch.zeros(1 << 20)}
    dcp.load(out, storage_reader=TieredStorageReader("zoc-ck2"), no_dist=True)
    assert torch.equal(out["w"], torch.full((1 << 20,), 2.0))  # step 2, not the torn 3


def _fsdp2_worker(rank: int, world: int, socket: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["TIERCKPT_SOCKET"] = socket
    mesh = init_device_mesh("cpu", (world,))

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(9, 13), nn.ReLU(), nn.Linear(13, 5))
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=0.01)

    def train(
        m: nn.Module, o: torch.optim.Optimizer, steps: int, ckpt: Checkpointer | None
    ) -> None:
        g = torch.Generator().manual_seed(dist.get_rank())
        for step in range(1, steps + 1):
            m(torch.randn(4, 9, generator=g)).square().mean().backward()
            o.step()  # with a save in flight: waits for its stage
            o.zero_grad()
            if ckpt is not None:
                msd, osd = get_state_dict(m, o)
                ckpt.save(step, {"model": msd, "optim": osd})

    model, opt = build()
    with Checkpointer("zoc-fsdp", handle_signals=False, async_staging=True) as ckpt:
        train(model, opt, 3, ckpt)
        ckpt.wait()
        expected = {k: v.full_tensor() for k, v in model.state_dict().items()}
        _, osd = get_state_dict(model, opt)
        expected_opt = {
            (fqn, n): v.full_tensor() if hasattr(v, "full_tensor") else v
            for fqn, entries in osd["state"].items()
            for n, v in entries.items()
        }
        again, again_opt = build()
        train(again, again_opt, 1, None)  # optimizer state to load into
        msd, osd = get_state_dict(again, again_opt)
        state = {"model": msd, "optim": osd}
        assert ckpt.restore(state) == 3
        set_state_dict(
            again, again_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    for k, v in again.state_dict().items():
        assert torch.equal(v.full_tensor(), expected[k]), k
    _, osd = get_state_dict(again, again_opt)
    for fqn, entries in osd["state"].items():
        for n, v in entries.items():
            got = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert torch.equal(got, expected_opt[(fqn, n)]), (fqn, n)


@pytest.mark.slow
def test_fsdp2_two_ranks_resume_bit_exact_with_asynchronous_staging(daemon: DaemonProcess) -> None:
    run_ranks(_fsdp2_worker, 2, str(daemon.socket))
