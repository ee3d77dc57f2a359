"""Replicated state is stored once (issue 38): DDP, HSDP 2x2, TP x DP and a state that changes
between saves, saved with ``async_save`` (THREAD and PROCESS) on real gloo ranks through a real
daemon with a ``file://`` persistent tier. The bytes the daemon holds in memory and the bytes of
the durable step are at most 1.05x what torch's ``FileSystemWriter`` writes for the same state;
from the second save of a layout on, each rank copies at ``stage()`` only what it writes; values
changed right after ``async_save`` returns never reach the step; every rank loads bit-exact."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tierckpt_client import DaemonClient
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp.export import export_step

from helpers import run_ranks, started

pytestmark = pytest.mark.slow

SLACK = 1.05


def _full(name: str, step: int, shape: tuple[int, ...]) -> torch.Tensor:
    seed = sum(name.encode()) * 7919 + step
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _dt(full: torch.Tensor, mesh: Any, placements: list[Any]) -> DTensor:
    """A DTensor of ``full`` from the local chunk (no collective)."""
    local = full
    for dim, p in enumerate(placements):
        if isinstance(p, Shard):
            local = local.chunk(mesh.size(dim), dim=p.dim)[mesh.get_coordinate()[dim]]
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False)


def _state(kind: str, step: int, mesh: Any, version: int = 1) -> dict[str, Any]:
    """~1.3 MB per rank; ``version`` 2 (kind "change") adds a tensor and shards a replicated one."""
    shape = (128, 256)
    if kind in ("ddp", "lowest", "change", "nodedup"):
        model: dict[str, Any] = {f"w{i}": _full(f"w{i}", step, shape) for i in range(4)}
        if kind == "nodedup":  # replicated DTensors: chunks, so DCP accepts every rank writing
            model = {k: _dt(v, mesh, [Replicate()]) for k, v in model.items()}
        if version == 2:
            model["w0"] = _dt(model["w0"], mesh, [Shard(0)])
            model["added"] = _full("added", step, (64, 64))
    else:
        placements = [Replicate(), Shard(0) if kind == "hsdp" else Shard(1)]
        model = {f"w{i}": _dt(_full(f"w{i}", step, shape), mesh, placements) for i in range(4)}
    if kind == "nodedup":  # no plain tensor, no bytes item: DCP refuses those twice
        return {"model": model}
    return {
        "model": model,
        "optim": {"exp_avg": _full("exp_avg", step, (256, 256)), "lr": 0.1},  # replicated
        "buf": _full("buf", step, (1000,)).to(torch.bfloat16),  # a replicated buffer (mixed)
        "step": step,
    }


def _blank(sd: dict[str, Any]) -> dict[str, Any]:
    def zero(v: Any) -> Any:
        if isinstance(v, DTensor):
            return DTensor.from_local(
                torch.zeros_like(v.to_local()), v.device_mesh, v.placements, run_check=False
            )
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        return None

    return zero(sd)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, DTensor):
        return isinstance(b, DTensor) and torch.equal(a.to_local(), b.to_local())
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _spoil(sd: dict[str, Any]) -> None:
    """Training changes every value right after async_save returns."""
    for v in sd.values():
        if isinstance(v, DTensor):
            v.to_local().add_(1000)
        elif isinstance(v, torch.Tensor):
            v.add_(1000)
        elif isinstance(v, dict):
            _spoil(v)


class NoDedupPlanner(DefaultSavePlanner):
    """A custom planner with dedup off: every rank writes every item it holds."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        plans, metadata = create_default_global_save_plan(all_plans)
        self.metadata = metadata
        return plans, metadata


def _planner(name: str) -> DefaultSavePlanner:
    if name == "nodedup":
        return NoDedupPlanner()
    return DefaultSavePlanner(dedup_save_to_lowest_rank=name == "lowest")


def _case(rank: int, world: int, out: str, kind: str, mode: str, planner: str) -> dict[int, int]:
    """Save three steps of ``kind`` (and once with torch's writer); load two back; returns the
    bytes this rank copied at each step's ``stage()``."""
    mesh = init_device_mesh(
        "cpu", (world,) if kind in ("ddp", "lowest", "change", "nodedup") else (2, 2)
    )
    group = dist.new_group(backend="gloo")
    version = {1: 1, 2: 2 if kind == "change" else 1, 3: 2 if kind == "change" else 1}
    # torch's own writer, same state, same planner: the bytes to match.
    dcp.save(
        _state(kind, 0, mesh, version[3]),
        storage_writer=FileSystemWriter(os.path.join(out, kind, "fs")),
        planner=_planner(planner),
        process_group=group,
    )
    staged = {}
    for step in (1, 2, 3):
        sd = _state(kind, step, mesh, version[step])
        writer = TieredStorageWriter(kind, step, persist=True)
        fut = dcp.async_save(
            sd,
            storage_writer=writer,
            planner=_planner(planner),
            process_group=group,
            async_checkpointer_type=AsyncCheckpointerType(mode),
        )
        staged[step] = getattr(writer, "last_stage_bytes", -1)  # -1: a writer before issue 38
        _spoil(sd)
        fut.result()
    for step in (2, 3):
        want = _state(kind, step, mesh, version[step])
        dest = _blank(want)
        dcp.load(dest, storage_reader=TieredStorageReader(kind, step), process_group=group)
        assert _equal(dest, want), (kind, rank, step)
    if kind in ("ddp", "hsdp"):  # resharded: DDP -> FSDP, HSDP 2x2 -> 1x4 (Shard(0) over all)
        flat = init_device_mesh("cpu", (world,))
        want = _state(kind, 3, mesh)
        dest = _blank(want)
        dest["model"] = {k: _dt(torch.zeros(128, 256), flat, [Shard(0)]) for k in want["model"]}
        dcp.load(dest, storage_reader=TieredStorageReader(kind, 3), process_group=group)
        for k, v in want["model"].items():
            full = v.full_tensor() if isinstance(v, DTensor) else v
            assert torch.equal(dest["model"][k].full_tensor(), full), (kind, rank, k)
    return staged


def _worker(rank: int, world: int, socket: str, out: str, cases: list[tuple[str, str, str]]):
    os.environ["TIERCKPT_SOCKET"] = socket
    for kind, mode, planner in cases:
        staged = _case(rank, world, out, kind, mode, planner)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, staged)
        if rank == 0:
            Path(out, kind, "staged.json").write_text(json.dumps(everyone))
    if world == 2:
        _planner_switch(rank, world)


def _planner_switch(rank: int, world: int) -> None:
    """The dedup option changes between two saves of one layout: the save that finds an item
    it did not copy fails with a clear error on every rank and commits nothing; the next save
    copies everything and succeeds, the one after copies only its share again."""
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")

    def save(step: int, planner: str) -> int:
        sd = _state("ddp", step, mesh)
        writer = TieredStorageWriter("switch", step)
        fut = dcp.async_save(
            sd,
            storage_writer=writer,
            planner=_planner(planner),
            process_group=group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
        _spoil(sd)
        fut.result()
        return writer.last_stage_bytes

    full = save(1, "balanced")
    assert 0 < save(2, "balanced") < full  # only this rank's share
    try:
        save(3, "lowest")  # rank 0 now writes everything, but copied only its share
    except BaseException as e:  # DCP's CheckpointException (a BaseException), on every rank
        failed = str(e)
    else:
        failed = ""
    assert "which stage() did not copy" in failed, (rank, failed)
    assert "the next one copies everything" in failed
    # Rank 0 forgot and copies everything; rank 1 wrote its (empty) share of save 3.
    assert save(4, "lowest") == (full if rank == 0 else 0)
    assert save(5, "lowest") == (full if rank == 0 else 0)
    with DaemonClient.from_socket(os.environ["TIERCKPT_SOCKET"]) as c:
        states = {s.step: s.state.value for s in c.steps("switch")}
    assert states.get(3) in (None, "writing"), states  # 3 was never committed
    assert states[4] != "writing" and states[5] != "writing", states
    for step in (4, 5):
        want = _state("ddp", step, mesh)
        dest = _blank(want)
        dcp.load(dest, storage_reader=TieredStorageReader("switch", step), process_group=group)
        assert _equal(dest, want), (rank, step)


def _data_bytes(root: Path, suffix: str) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.name.endswith(suffix))


# (state, async_save mode, planner) on 2 and on 4 ranks: one spawn per world size.
CASES = {
    2: [
        ("ddp", "thread", "balanced"),
        ("lowest", "process", "lowest"),
        ("change", "thread", "balanced"),
        ("nodedup", "thread", "nodedup"),
    ],
    4: [
        ("ddp", "process", "balanced"),
        ("hsdp", "thread", "balanced"),
        ("tpdp", "process", "balanced"),
    ],
}


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_state_is_stored_once(tmp_path: Path, world: int) -> None:
    store = tmp_path / "store"
    cases = CASES[world]
    with started(persist_url=f"file://{store}", keep_last=3, capacity="256M") as d:
        run_ranks(_worker, world, str(d.socket), str(tmp_path), cases)
        memory = {}
        with DaemonClient.from_socket(d.socket) as c:
            for kind, _, _ in cases:
                memory[kind] = {s.step: s.bytes for s in c.steps(kind)}
        for kind, _, _ in cases:
            for step in (1, 2, 3):
                marker = store / kind / f"step_{step:012d}" / "COMMITTED"
                deadline = time.monotonic() + 60
                while not marker.exists():
                    assert time.monotonic() < deadline, f"{kind}/step {step} never became durable"
                    time.sleep(0.1)
    for kind, _, _ in cases:
        _check(tmp_path, store, kind, memory[kind])
    if world == 2:  # no daemon now: exported from the persistent tier, read by torch's reader
        config = ClientConfig(socket=tmp_path / "no-daemon.sock", persist_url=f"file://{store}")
        assert export_step("ddp", 3, tmp_path / "export", config=config) == 3
        want = _state("ddp", 3, None)
        dest = _blank(want)
        dcp.load(dest, storage_reader=FileSystemReader(tmp_path / "export"), no_dist=True)
        assert _equal(dest, want)


def _check(tmp_path: Path, store: Path, kind: str, memory: dict[int, int]) -> None:
    torch_bytes = _data_bytes(tmp_path / kind / "fs", ".distcp")
    durable = {
        s: sum(_data_bytes(store / kind / f"step_{s:012d}", x) for x in (".data", ".extra"))
        for s in (1, 2, 3)
    }
    staged = json.loads((tmp_path / kind / "staged.json").read_text())
    report = f"{kind}: torch {torch_bytes}, memory {memory}, durable {durable}, staged {staged}"
    # Every step, the first of its layout too: no byte that no metadata entry references.
    for step in (3,) if kind == "change" else (1, 2, 3):
        assert memory[step] <= SLACK * torch_bytes, report
        assert durable[step] <= SLACK * torch_bytes, report
    # From the second save of a layout on, the ranks together copy what they write, once.
    assert 0 < sum(r["3"] for r in staged) <= SLACK * torch_bytes, report
    if kind != "nodedup":  # the first save of a layout copies everything
        assert sum(r["1"] for r in staged) > 1.5 * torch_bytes, report
