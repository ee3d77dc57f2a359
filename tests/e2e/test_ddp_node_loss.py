"""A 2-node DDP job (2 ranks per node, every tensor replicated) saving into the nodes' memory:
each node holds, and each peer receives, about what torch's ``FileSystemWriter`` stores for the
whole job, not one copy per rank (issue 38); after node B is lost, the job resumes bit-exact
from node A's memory and the replica of B's share it holds. The persistent tier (SeaweedFS)
holds the step's bytes once too."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from seaweed import SeaweedS3
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import DaemonProcess, ring, run_ranks, wait_until

pytestmark = pytest.mark.slow

TOKEN = "peer-token-for-the-tests-0123456789"
NS = "ddp2n"


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {f"layer{i}": torch.randn(256, 256, generator=g) for i in range(4)},
        "optim": {"exp_avg": torch.randn(512, 256, generator=g), "lr": 0.01},
        "step": step,
    }


def _save(rank: int, world: int, sockets: list[str], fs: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = sockets[rank // 2]  # ranks 0-1 on node A, 2-3 on node B
    group = dist.new_group(backend="gloo")
    dcp.save(_state(0), storage_writer=FileSystemWriter(fs), process_group=group)
    for step in (1, 2):
        sd = _state(step)
        fut = dcp.async_save(
            sd,
            storage_writer=TieredStorageWriter(NS, step),
            process_group=group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )
        for t in sd["model"].values():  # type: ignore[attr-defined]
            t.add_(1000)
        fut.result()


def _resume(rank: int, world: int, sockets: list[str]) -> None:
    os.environ["TIERCKPT_SOCKET"] = sockets[rank // 2]
    group = dist.new_group(backend="gloo")
    dest = _state(99)
    reader = TieredStorageReader(NS, process_group=group)
    dcp.load(dest, storage_reader=reader, process_group=group)
    assert reader.resolved_step == 2
    want = _state(2)
    for k, v in want["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(dest["model"][k], v), (rank, k)  # type: ignore[index]
    assert torch.equal(dest["optim"]["exp_avg"], want["optim"]["exp_avg"])  # type: ignore[index]
    assert dest["step"] == 2


def _metric(d: DaemonProcess, name: str) -> float:
    for line in httpx.get(f"http://{d.name}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}_total "):
            return float(line.split()[1])
    return 0.0


def _durable_bytes(s3: SeaweedS3, prefix: str) -> int | None:
    """Bytes of the step's data files in the persistent tier once it is committed there."""
    client = s3.boto3_client()
    try:
        objs = client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])
    finally:
        client.close()
    names = {o["Key"].rsplit("/", 1)[1]: o["Size"] for o in objs}
    if "COMMITTED" not in names:
        return None
    return sum(n for k, n in names.items() if k.endswith((".data", ".extra")))


def test_ddp_on_two_nodes_stores_one_copy_and_resumes_after_node_loss(
    tmp_path: Path, s3_env: SeaweedS3
) -> None:
    url = f"s3://{s3_env.bucket}/ddp-node-loss-{uuid.uuid4().hex[:8]}"
    nodes = ring(
        2, token=TOKEN, replicas=1, prefix="tierckpt-test", capacity="256M", persist_url=url
    )
    b = nodes[1]
    try:
        for d in nodes:
            d.start()
        sockets = [str(d.socket) for d in nodes]
        run_ranks(_save, 4, sockets, str(tmp_path / "fs"))
        torch_bytes = sum(p.stat().st_size for p in (tmp_path / "fs").glob("*.distcp"))
        deadline = time.monotonic() + 60
        while any((d.status() or {}).get("replication", {}).get("queued_steps") for d in nodes):
            assert time.monotonic() < deadline, "replication did not settle"
            time.sleep(0.2)
        held = {}
        for d in nodes:
            with DaemonClient.from_socket(d.socket) as c:
                held[d.name] = c.step(NS, 2).bytes
        received = {d.name: _metric(d, "tierckpt_replica_received_bytes") for d in nodes}
        report = f"torch {torch_bytes}, held {held}, received {received}"
        # Each node holds its own share and the replica of the other's: the job's bytes once
        # (not one copy per rank), per step; each peer received the other node's share only.
        for name in held:
            assert held[name] <= 1.05 * torch_bytes, report
        # Two steps replicated, each node's share of each: the job's bytes twice in all.
        assert 0 < sum(received.values()) <= 1.05 * 2 * torch_bytes, report
        prefix = url.split("/", 3)[3] + f"/{NS}/step_{2:012d}/"
        durable = wait_until("step 2 durable in S3", lambda: _durable_bytes(s3_env, prefix))
        assert durable <= 1.05 * torch_bytes, f"{report}, durable {durable}"

        b.lose_node()
        b.start()
        run_ranks(_resume, 4, sockets)
    finally:
        for d in nodes:
            d.cleanup()
