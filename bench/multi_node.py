"""Multi-node checkpointing on one machine: two daemons as two nodes, peers of each other.

Two ranks save the same state over and over, alternating between two placements in one run so
that both see the same machine state: *single* (both ranks on one standalone daemon, a commit on
one daemon) and *multi* (rank 0 on node A, rank 1 on node B of a ring with one replica, the commit
across both). Per save: the
stall (``async_save`` returned) and time to committed (its future resolved), each against a
memcpy of the rank's state timed right before. Then node B is lost (daemon killed, memory wiped),
a replacement starts, and both ranks load the newest multi-node step: restore time, and the bytes
node B pulled from its peer.

    python bench/multi_node.py --size-mb 256 --iters 8 --out bench/results/multi_node.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from harness import Row, free_port, machine_info, sized_child, write_results
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tierckpt_client import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.launcher import DaemonProcess, new_shm_dir, ring

TOKEN = "bench-peer-token-not-a-secret-0123456789"
NS = "bench-multi"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256, help="state per rank, MiB")
    p.add_argument("--iters", type=int, default=8, help="saves per placement")
    p.add_argument("--out", type=Path, default=Path("bench/results/multi_node.json"))
    p.add_argument("--smoke", action="store_true", help="16 MiB, 3 saves each (CI)")
    args = p.parse_args()
    if args.smoke:
        args.size_mb, args.iters = 16, 3
    if args.iters < 2:
        p.error("--iters must be at least 2")
    return args


def _state(mesh: Any, size_mb: int, seed: int) -> dict[str, Any]:
    rows = size_mb * (1 << 20) // (4 * 1024) * mesh.size()
    full = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(seed))
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "meta": {"seed": seed}}


def _rank(rank: int, world: int, port: int, sockets: list[str], args: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world,))
    state = _state(mesh, args["size_mb"], 0)
    local = state["w"].to_local()
    scratch = torch.empty_like(local)
    placements = {"single": sockets[2], "multi": sockets[rank]}
    rows: dict[str, list[dict[str, float]]] = {"single": [], "multi": []}
    step = last_multi = 0
    for i in range(args["iters"]):
        for name in ("single", "multi") if i % 2 == 0 else ("multi", "single"):
            step += 1
            dist.barrier(group)
            t0 = time.perf_counter()
            scratch.copy_(local)
            memcpy = time.perf_counter() - t0
            writer = TieredStorageWriter(
                NS, step, config=ClientConfig.from_env(socket=placements[name])
            )
            dist.barrier(group)
            t0 = time.perf_counter()
            fut = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=group,
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
            )
            stall = time.perf_counter() - t0
            fut.result()
            committed = time.perf_counter() - t0
            rows[name].append({"stall": stall, "committed": committed, "memcpy": memcpy})
            if name == "multi":
                last_multi = step
    out: dict[str, Any] = {"rows": rows, "last_multi": last_multi}
    if rank == 0:
        Path(args["out"]).write_text(json.dumps(out))
    dist.barrier(group)
    dist.destroy_process_group()


def _restore(rank: int, world: int, port: int, sockets: list[str], args: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    mesh = init_device_mesh("cpu", (world,))
    dest = _state(mesh, args["size_mb"], 1)  # different values: the load must overwrite them
    config = ClientConfig.from_env(socket=sockets[rank])
    dist.barrier(group)
    t0 = time.perf_counter()
    reader = TieredStorageReader(NS, args["step"], config=config, process_group=group)
    dcp.load(dest, storage_reader=reader, process_group=group)
    dt = time.perf_counter() - t0
    expected = _state(mesh, args["size_mb"], 0)
    assert torch.equal(dest["w"].to_local(), expected["w"].to_local()), "restore is not bit-exact"
    if rank == 0:
        Path(args["out"]).write_text(json.dumps({"restore_s": dt}))
    dist.barrier(group)
    dist.destroy_process_group()


def _spawn(fn: Any, sockets: list[str], args: dict[str, Any]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        mp.spawn(fn, args=(2, free_port(), sockets, {**args, "out": out}), nprocs=2)
        result: dict[str, Any] = json.loads(Path(out).read_text())
    finally:
        os.unlink(out)
    return result


def _counter(d: DaemonProcess, name: str) -> float:
    for line in httpx.get(f"http://{d.name}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}_total "):
            return float(line.split()[1])
    return 0.0


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    steady = rows[1:]  # the first save of a placement faults in fresh tmpfs pages
    return {
        "stall_ms": statistics.median(r["stall"] for r in steady) * 1e3,
        "committed_ms": statistics.median(r["committed"] for r in steady) * 1e3,
        "memcpy_ms": statistics.median(r["memcpy"] for r in steady) * 1e3,
        "stall_over_memcpy": statistics.median(r["stall"] / r["memcpy"] for r in steady),
    }


WHAT = "two nodes (commit across nodes, node loss)"


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """The suite's run: at ``--multi-size-mb`` (this script's default if unset)."""
    return sized_child("multi_node.py", WHAT, args, "no_multi", "multi_size_mb", tmp, notes)


def rows(res: dict[str, Any]) -> list[Row]:
    """None in the suite's table: its figures are in the JSON (and this script's own output)."""
    return []


def main() -> None:
    args = parse_args()
    info = machine_info(size_mb=args.size_mb, iters=args.iters)
    tag = uuid.uuid4().hex[:8]
    nodes = ring(
        2,
        token=TOKEN,
        replicas=1,
        prefix=f"tierckpt-bench-mn-{tag}",
        capacity=f"{args.size_mb * (4 * args.iters + 4) + 1024}M",  # replication may lag
        keep_last=2,
        log_level="WARNING",
    )
    a, b = nodes
    alone = DaemonProcess(
        new_shm_dir(f"tierckpt-bench-one-{tag}"),
        capacity=f"{args.size_mb * 8 + 1024}M",
        keep_last=2,
        log_level="WARNING",
    )
    nodes.append(alone)
    try:
        for d in nodes:
            d.start()
        sockets = [str(a.socket), str(b.socket), str(alone.socket)]
        saved = _spawn(_rank, sockets, {"size_mb": args.size_mb, "iters": args.iters})
        single, multi = _summary(saved["rows"]["single"]), _summary(saved["rows"]["multi"])
        # Let replication settle before the node goes.
        deadline = time.monotonic() + 300
        while any(
            ((d.status() or {}).get("replication") or {}).get("queued_steps") for d in (a, b)
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("replication did not settle in 300 s")
            time.sleep(0.2)
        b.lose_node()
        b.start()
        step = saved["last_multi"]
        restored = _spawn(_restore, sockets, {"size_mb": args.size_mb, "step": step})
        pulled = _counter(b, "tierckpt_peer_hydrated_bytes")
        res = {
            "single": single,
            "multi": multi,
            "multi_stall_over_single": multi["stall_ms"] / single["stall_ms"],
            "multi_committed_over_single": multi["committed_ms"] / single["committed_ms"],
            "restore_node_b": {
                "step": step,
                "seconds": restored["restore_s"],
                "peer_bytes": pulled,
                "peer_MBps": pulled / restored["restore_s"] / 1e6,
                "persistent_bytes": 0,
            },
        }
    except BaseException:
        for d in nodes:
            print(f"daemon {d.name} log (tail):\n{d.log()}", file=sys.stderr)
        raise
    finally:
        for d in nodes:
            d.cleanup()
    print(
        f"{args.size_mb} MiB per rank, 2 ranks, {args.iters} saves per placement (median of "
        f"the steady ones)\n"
        f"  single node: stall {single['stall_ms']:.1f} ms ({single['stall_over_memcpy']:.2f}x "
        f"memcpy), committed {single['committed_ms']:.1f} ms\n"
        f"  two nodes:   stall {multi['stall_ms']:.1f} ms ({multi['stall_over_memcpy']:.2f}x "
        f"memcpy), committed {multi['committed_ms']:.1f} ms\n"
        f"  two nodes / one: stall {res['multi_stall_over_single']:.2f} (target <= 1.1), "
        f"committed {res['multi_committed_over_single']:.2f}\n"
        f"  node B lost, restore of step {step}: {restored['restore_s']:.2f} s, "
        f"{pulled / 1e6:.1f} MB from its peer ({pulled / restored['restore_s'] / 1e6:.0f} MB/s), "
        f"0 from the persistent tier"
    )
    write_results(args.out, info, res)


if __name__ == "__main__":
    main()
