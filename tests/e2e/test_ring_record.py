"""The global record of a step spanning nodes does not grow with the job on every node: a node
keeps its own share's file records (block checksums), of other nodes' shares only an entry per
node (file names, bytes, the digest of their records), and the DCP metadata only where the step says (its decider and
the next node); every other node fetches what a reader needs on demand, checked against the
digests, also when the decider's node is lost."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.errors import StepNotFoundError

from helpers import DaemonProcess, ring, run_ranks, running

pytestmark = pytest.mark.slow

TOKEN = "peer-token-for-the-tests-0123456789"
NS = "ringrec"


def _full() -> torch.Tensor:
    # 3 ranks x 1 MiB rows: each rank's file is large enough for several block checksums.
    return torch.randn(3 * 64, 4096, generator=torch.Generator().manual_seed(7))


def _save(rank: int, world: int, sockets: list[str]) -> None:
    os.environ["TIERCKPT_SOCKET"] = sockets[rank]
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")
    sd = {"w": distribute_tensor(_full(), mesh, [Shard(0)]), "meta": {"step": 5}}
    dcp.async_save(
        sd,
        storage_writer=TieredStorageWriter(NS, 5),
        process_group=group,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    ).result()


def _load(rank: int, world: int, sockets: list[str]) -> None:
    os.environ["TIERCKPT_SOCKET"] = sockets[rank]
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")
    dest = {
        "w": distribute_tensor(torch.zeros(3 * 64, 4096), mesh, [Shard(0)]),
        "meta": {"step": -1},
    }
    reader = TieredStorageReader(NS, process_group=group)
    dcp.load(dest, storage_reader=reader, process_group=group)
    assert reader.resolved_step == 5
    assert torch.equal(dest["w"].full_tensor(), _full())
    assert dest["meta"] == {"step": 5}


def _record_path(d: DaemonProcess) -> Path:
    (path,) = (d.shm_dir / "ns" / NS).glob("000000000005-*/MANIFEST.json")
    return path


def _record(d: DaemonProcess) -> dict:
    doc: dict = json.loads(_record_path(d).read_text())
    return doc


@pytest.fixture
def three() -> Iterator[list[DaemonProcess]]:
    with running(ring(3, token=TOKEN, replicas=1, prefix="tierckpt-test", capacity="256M")) as n:
        yield n


def test_a_node_keeps_its_share_and_digests_and_reads_the_rest_on_demand(
    three: list[DaemonProcess],
) -> None:
    sockets = [str(d.socket) for d in three]
    run_ranks(_save, 3, sockets)
    decider = three[0]  # rank 0's daemon decides
    records = {d.name: _record(d) for d in three}
    ring_record = records[decider.name]["ring"]
    holders = ring_record["metadata_holders"]
    assert holders[0] == decider.name and len(holders) == 2
    assert sorted(ring_record["shares"]) == sorted(d.name for d in three)
    (other,) = [d for d in three if d.name not in holders]
    for d in three:
        doc = records[d.name]
        assert doc["ring"] == ring_record  # every node has every share's digest
        shares = doc["ring"]["shares"]
        held = {f["name"] for f in doc["files"]}  # its own share, and a replica of another's
        assert set(shares[d.name]["files"]) <= held
        assert all(f.get("blocks") for f in doc["files"])  # what it holds: block checksums
        # Of the rest, no file record: per node its files' names, bytes and records' digest.
        rest = {name for s in shares.values() for name in s["files"]} - held
        assert rest and all(s["digest"].startswith("sha256:") for s in shares.values())
        assert bool(doc["metadata"]) == (d.name in holders)
    # Every rank, the node without the metadata included, loads the step bit for bit.
    run_ranks(_load, 3, sockets)
    # The decider's node is lost: the two left reshard, reading its share from its replica
    # (block checksums from there, checked against the digest) and the metadata from the
    # other holder.
    decider.lose_node()
    left = [d for d in three if d is not decider]
    assert other in left
    run_ranks(_load, 2, [str(d.socket) for d in left])
    with DaemonClient.from_socket(other.socket) as c:
        assert c.step(NS, 5).files  # still its committed step


def test_metadata_that_does_not_match_its_digest_is_refused(three: list[DaemonProcess]) -> None:
    sockets = [str(d.socket) for d in three]
    run_ranks(_save, 3, sockets)
    decider = three[0]
    holders = _record(decider)["ring"]["metadata_holders"]
    (other,) = [d for d in three if d.name not in holders]
    # Both holders' copies of the metadata are changed behind the daemons' backs.
    for d in three:
        if d.name in holders:
            path = _record_path(d)
            doc = json.loads(path.read_text())
            doc["metadata"]["forged"] = True
            path.write_text(json.dumps(doc))
    c = DaemonClient.from_socket(other.socket)
    with c, pytest.raises(StepNotFoundError, match="does not match the step's digest"):
        c.metadata(NS, 5)


def _as_previous_format(doc: dict, slim: dict[str, dict]) -> dict:
    """A node's record as the daemons before per-node share entries wrote it: every other
    node's file slim in ``files``, the files held here in ``local.held``, a bare digest per
    share."""
    held = {f["name"] for f in doc["files"]}
    doc["files"] = sorted(
        doc["files"] + [s for name, s in slim.items() if name not in held],
        key=lambda f: f["name"],
    )
    doc["local"]["held"] = sorted(held)
    doc["ring"]["shares"] = {n: s["digest"] for n, s in doc["ring"]["shares"].items()}
    return doc


def test_a_step_recorded_in_the_previous_format_still_loads(three: list[DaemonProcess]) -> None:
    sockets = [str(d.socket) for d in three]
    run_ranks(_save, 3, sockets)
    records = {d.name: _record(d) for d in three}
    slim = {
        f["name"]: {k: f[k] for k in ("name", "rank", "length", "checksum", "node")}
        for doc in records.values()
        for f in doc["files"]
    }
    for d in three:
        d.kill()
        _record_path(d).write_text(json.dumps(_as_previous_format(records[d.name], slim)))
    for d in three:
        d.start()
    # "latest" finds the step whole, and every rank loads it bit for bit (other nodes' files
    # read through the share records their holders send, checked against the old digests).
    run_ranks(_load, 3, sockets)
    for d in three:
        assert "discarding" not in d.log()
