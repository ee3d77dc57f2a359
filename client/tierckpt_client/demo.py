"""Demo: a 4-rank FSDP2 job on 2 simulated nodes checkpoints every step into memory, loses a node, resumes.

Run ``python -m tierckpt_client.demo``. It starts two daemons on this machine as two "nodes" (A
and B: each its own tmpfs directory, TCP port and node name, peers of each other, one replica of
each node's share on the other) with the embedded default persistent tier, a ``file://``
directory (no S3 needed), and removes everything at the end. Then:

1. a reference run trains a small transformer for ``--steps`` steps without checkpoints;
2. run 1 trains the same model with ranks 0-1 on node A and 2-3 on node B, ``async_save`` after
   every step (each rank stages into its own node's memory; the step is committed across both
   nodes), and dies after step ``--crash-at``;
3. node B is lost: its daemon is killed and its memory wiped; a replacement starts empty under
   the same name;
4. run 2 resumes from the latest step: node A's ranks read their own memory, the replacement B
   pulls only its lost share from A's replica, and training goes on. The losses after the resume
   equal the reference run's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

NAMESPACE = "demo-job"
RANKS_PER_NODE = 2
TOKEN = "demo-peer-token-not-a-secret-0123456789"


def _rank(
    rank: int,
    world: int,
    port: int,
    sockets: list[str],
    first: int,
    last: int,
    out: str,
    save: bool,
) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # a toy model's views
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sockets:  # this rank's node: ranks 0-1 on node A, 2-3 on node B
        os.environ["TIERCKPT_SOCKET"] = sockets[rank // RANKS_PER_NODE]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ckpt_group = dist.new_group(backend="gloo")  # checkpoint collectives off the training group
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(512, 64),
        nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True),
        nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0, batch_first=True),
        nn.Linear(64, 512),
    )
    for layer in (*model, model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report: dict[str, Any] = {"losses": {}, "stall_ms": {}}
    step = first
    if first > 0:  # a restarted job: resume from the newest step, agreed by all ranks
        msd, osd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": msd, "optim": osd, "train": {"step": -1}}
        reader = TieredStorageReader(NAMESPACE, process_group=ckpt_group)
        t0 = time.perf_counter()
        dcp.load(state, storage_reader=reader, process_group=ckpt_group)
        report["restore_s"] = time.perf_counter() - t0
        read = torch.tensor([reader.read_bytes], dtype=torch.int64)
        dist.all_reduce(read, group=ckpt_group)
        report["read_bytes"] = int(read.item())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["train"]["step"]
        report["resumed"] = step
    pending: Future[Any] | None = None
    while step < last:
        step += 1
        gen = torch.Generator().manual_seed(1000 * step + rank)  # the data depends on the step
        tokens = torch.randint(0, 512, (8, 16), generator=gen)
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        report["losses"][step] = loss.item()
        if save:
            if pending is not None:
                pending.result()  # one save in flight at a time
            msd, osd = get_state_dict(model, opt)
            t0 = time.perf_counter()
            response = dcp.async_save(
                {"model": msd, "optim": osd, "train": {"step": step}},
                storage_writer=TieredStorageWriter(NAMESPACE, step),
                process_group=ckpt_group,
            )
            assert isinstance(response, Future)  # the writer stages synchronously
            pending = response
            report["stall_ms"][step] = (time.perf_counter() - t0) * 1e3
    if pending is not None:
        pending.result()
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _run(world: int, sockets: list[str], first: int, last: int, save: bool) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from tierckpt_core.launcher import free_port

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        mp.spawn(_rank, args=(world, free_port(), sockets, first, last, out, save), nprocs=world)
        report: dict[str, Any] = json.loads(Path(out).read_text())
    finally:
        os.unlink(out)
    report["losses"] = {int(k): v for k, v in report["losses"].items()}
    report["stall_ms"] = {int(k): v for k, v in report["stall_ms"].items()}
    return report


def _metric(daemon: Any, name: str) -> float:
    """A counter of ``daemon``'s /metrics."""
    import httpx

    text = httpx.get(f"http://{daemon.name}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"{name}_total "):
            return float(line.split()[1])
    return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crash-at", type=int, default=6, help="step after which run 1 dies")
    p.add_argument("--steps", type=int, default=10, help="last training step")
    args = p.parse_args(argv)
    if not 1 <= args.crash_at < args.steps:
        p.error("--crash-at must be at least 1 and below --steps")
    from tierckpt_core.launcher import ring

    world = 2 * RANKS_PER_NODE
    store = Path(tempfile.mkdtemp(prefix="tierckpt-demo-store-"))
    nodes = ring(
        2,
        token=TOKEN,
        replicas=1,
        prefix="tierckpt-demo",
        capacity="2G",
        keep_last=2,
        persist_url=f"file://{store}",
        persist_every=5,
        log_level="WARNING",
    )
    node_a, node_b = nodes
    try:
        for n in nodes:
            n.start()
        sockets = [str(n.socket) for n in nodes]
        print(f"node A: daemon {node_a.name}, memory tier {node_a.shm_dir}")
        print(f"node B: daemon {node_b.name}, memory tier {node_b.shm_dir}")
        print(f"persistent tier: file://{store} (every 5th step)")
        print(f"--- reference: {args.steps} steps, 4 ranks, no checkpoints")
        reference = _run(world, [], 0, args.steps, save=False)["losses"]
        print(
            f"--- run 1: ranks 0-1 on node A, 2-3 on node B, async_save every step, dies after "
            f"step {args.crash_at}"
        )
        run1 = _run(world, sockets, 0, args.crash_at, save=True)
        for step, ms in sorted(run1["stall_ms"].items()):
            print(f"  step {step:3d}  loss {run1['losses'][step]:.6f}  save stall {ms:6.1f} ms")
        print("--- node B is lost: its daemon is killed and its memory wiped; a new B starts")
        node_b.lose_node()
        node_b.start()
        before = {n.name: _metric(n, "tierckpt_peer_hydrated_bytes") for n in nodes}
        durable_before = sum(_metric(n, "tierckpt_hydrated_bytes") for n in nodes)
        print(f"--- run 2: resume from the latest step and train to step {args.steps}")
        run2 = _run(world, sockets, 1, args.steps, save=True)
        peer = sum(_metric(n, "tierckpt_peer_hydrated_bytes") - before[n.name] for n in nodes)
        durable = sum(_metric(n, "tierckpt_hydrated_bytes") for n in nodes) - durable_before
        print(
            f"  resumed from step {run2['resumed']} in {run2['restore_s']:.2f} s. Bytes by source: "
            f"peers {peer / 1e6:.2f} MB (node B's lost share, pulled from node A's replica and "
            f"verified), persistent tier {durable / 1e6:.2f} MB; then the 4 ranks read "
            f"{run2['read_bytes'] / 1e6:.2f} MB of tensors from their own node's memory"
        )
        same = True
        for step in sorted(run2["losses"]):
            a, b = run2["losses"][step], reference[step]
            same &= a == b
            print(
                f"  step {step:3d}  loss {a:.6f}  uninterrupted {b:.6f}  {'equal' if a == b else 'DIFFERENT'}"
            )
        if run2["resumed"] != args.crash_at or not same:
            print("unexpected: the resumed run differs from the uninterrupted one", file=sys.stderr)
            return 1
        print("--- the resumed losses equal the uninterrupted run's, bit for bit")
    except BaseException:
        for n in nodes:
            print(f"daemon {n.name} log (tail):\n{n.log()}", file=sys.stderr)
        raise
    finally:
        for n in nodes:
            n.cleanup()
        shutil.rmtree(store, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
