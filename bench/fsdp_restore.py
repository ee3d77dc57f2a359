"""The restore of an FSDP2-style state (``DTensor`` parameters sharded ``Shard(0)`` over the
ranks' mesh) from the memory tier, with the Checkpointer's load plan beside DCP's own, in one run.

Each rank saves its shards of ``--params`` parameters (four shapes, as a transformer's layers
repeat theirs) once through a real daemon, then loads them back ``--iters`` rounds, each round
both ways in turn on the same reader, step and tensors: ``dcp.load`` with DCP's
``DefaultLoadPlanner`` (what a user of plain ``dcp.load`` gets) and with
``tierckpt_client._load_plan.LoadPlanner`` (what ``Checkpointer.restore`` uses). Every load is
checked bit-exact against the saved values. The time counts from before the load to after a
barrier behind it (the slower rank). Also timed alone: planning and resolving every item, on
rank 0 (``plan_us_per_param``).

    python bench/fsdp_restore.py --ranks 2 --params 2048 --iters 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from harness import free_port, machine_info, running_daemon

SHAPES = [(64, 128), (128,), (128, 64), (64,)]  # float32: 32 KiB, 512 B, 32 KiB, 256 B


def _state(mesh: Any, n: int, seed: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i // 4}.p{i % 4}": torch.nn.Parameter(
            distribute_tensor(torch.randn(*SHAPES[i % 4], generator=g), mesh, [Shard(0)])
        )
        for i in range(n)
    }


def _rank(rank: int, world: int, sock: str, port: int, args: Any, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TIERCKPT_SOCKET=sock)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.device_mesh import init_device_mesh

    from tierckpt_client import _load_plan
    from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

    mesh = init_device_mesh("cpu", (world,))
    saved = _state(mesh, args.params, 1)
    dcp.save(saved, storage_writer=TieredStorageWriter("fsdp-bench", 1))
    state = _state(mesh, args.params, 2)
    planners = {"dcp": DefaultLoadPlanner, "tierckpt": _load_plan.LoadPlanner}
    times: dict[str, list[float]] = {k: [] for k in planners}
    for _ in range(args.iters):
        for name, planner in planners.items():
            for p in state.values():
                p._local_tensor.zero_()
            reader = TieredStorageReader("fsdp-bench", 1)
            dist.barrier()
            t = time.perf_counter()
            dcp.load(state, storage_reader=reader, planner=planner())
            dist.barrier()
            times[name].append((time.perf_counter() - t) * 1e3)
            for k, p in state.items():
                if not torch.equal(p._local_tensor, saved[k]._local_tensor):
                    raise AssertionError(f"{name}: {k} differs after the load")
    plan_us: dict[str, float] = {}
    if rank == 0:
        md = TieredStorageReader("fsdp-bench", 1).read_metadata()
        for name, planner in planners.items():
            best = float("inf")
            for _ in range(3):
                p = planner()
                p.set_up_planner(state, md, True)
                t = time.perf_counter()
                plan = p.finish_plan(p.create_local_plan())
                for item in plan.items:
                    p.resolve_tensor(item)
                best = min(best, time.perf_counter() - t)
            plan_us[name] = best / args.params * 1e6
        Path(out).write_text(json.dumps({"times": times, "plan_us_per_param": plan_us}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--params", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    with running_daemon(2048) as d, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(args.ranks, str(d.socket), free_port(), args, out), nprocs=args.ranks)
        res = json.loads(Path(out).read_text())
    info = machine_info(ranks=args.ranks, params=args.params, iters=args.iters)
    print(json.dumps(info))
    med = {k: statistics.median(v[args.warmup :]) for k, v in res["times"].items()}
    for k, v in res["times"].items():
        print(
            f"{k:9s} restore median {med[k]:7.1f} ms  plan+resolve "
            f"{res['plan_us_per_param'][k]:5.1f} us/param  rounds {[round(x, 1) for x in v]}"
        )
    print(f"DCP's plan / tierckpt's: {med['dcp'] / med['tierckpt']:.2f}x")


if __name__ == "__main__":
    main()
