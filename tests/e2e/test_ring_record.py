"""The global record of a step spanning nodes does not grow with the job on every node: a node
keeps its own share's file records (block checksums); the share table (per node its file names,
bytes and the digest of their records) and the DCP metadata only where the step says (its decider
and the next node), every other node their digests; what a reader needs is fetched on demand,
checked against the digests, also when the decider's node is lost."""

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
from tierckpt_core.metadata_blob import (
    PREFIX,
    canonical_json,
    metadata_digest,
    pack_metadata,
    unpack_metadata,
)

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
    shares = ring_record["shares"]
    for d in three:
        doc = records[d.name]
        if d.name in holders:
            assert doc["ring"] == ring_record  # the share table
        else:  # the table's digest, not the table
            assert "shares" not in doc["ring"]
            assert doc["ring"] == {k: v for k, v in ring_record.items() if k != "shares"}
        held = {f["name"] for f in doc["files"]}  # its own share, and a replica of another's
        assert set(shares[d.name]["files"]) <= held
        assert all(f.get("blocks") for f in doc["files"])  # what it holds: block checksums
        # Of the rest, no file record: per node its files' names, bytes and records' digest.
        rest = {name for s in shares.values() for name in s["files"]} - held
        assert rest and all(s["digest"].startswith("sha256:") for s in shares.values())
        # The metadata on the holders only, as the writer sent it: compressed text.
        assert doc["metadata"].startswith(PREFIX) == (d.name in holders)
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
            forged = unpack_metadata(doc["metadata"], where=str(path))
            forged["forged"] = True
            doc["metadata"] = pack_metadata(forged)
            path.write_text(json.dumps(doc))
    c = DaemonClient.from_socket(other.socket)
    with c, pytest.raises(StepNotFoundError, match="does not match the step's digest"):
        c.metadata(NS, 5)


def _with_table_everywhere(doc: dict, table: dict) -> dict:
    """A node's record as the daemons before the share table was kept once per ring wrote it:
    every node with the whole table (per node its files' names, bytes and records' digest), no
    digest of the table."""
    doc["ring"].pop("shares_digest", None)
    doc["ring"]["shares"] = table
    return doc


def _as_slim_file_format(doc: dict, table: dict, slim: dict[str, dict]) -> dict:
    """A node's record as the daemons before per-node share entries wrote it: every other
    node's file slim in ``files``, the files held here in ``local.held``, a bare digest per
    share."""
    held = {f["name"] for f in doc["files"]}
    doc["files"] = sorted(
        doc["files"] + [s for name, s in slim.items() if name not in held],
        key=lambda f: f["name"],
    )
    doc["local"]["held"] = sorted(held)
    doc["ring"].pop("shares_digest", None)
    doc["ring"]["shares"] = {n: s["digest"] for n, s in table.items()}
    return doc


def _with_json_metadata(doc: dict, metadata: dict) -> dict:
    """A node's record as the daemons before the metadata was kept as the writer's compressed
    text wrote it: the JSON object on the holders, and the digest of its canonical JSON."""
    if doc["metadata"]:
        doc["metadata"] = metadata
    doc["ring"]["metadata_digest"] = metadata_digest(canonical_json(metadata))
    return doc


@pytest.mark.parametrize("previous", ["table_everywhere", "slim_files", "json_metadata"])
def test_a_step_recorded_in_a_previous_format_still_loads(
    three: list[DaemonProcess], previous: str
) -> None:
    sockets = [str(d.socket) for d in three]
    run_ranks(_save, 3, sockets)
    records = {d.name: _record(d) for d in three}
    table = records[three[0].name]["ring"]["shares"]  # the decider keeps it
    metadata = unpack_metadata(records[three[0].name]["metadata"], where="the decider")
    slim = {
        f["name"]: {k: f[k] for k in ("name", "rank", "length", "checksum", "node")}
        for doc in records.values()
        for f in doc["files"]
    }
    for d in three:
        d.kill()
        doc = records[d.name]
        if previous == "table_everywhere":
            old = _with_table_everywhere(doc, table)
        elif previous == "slim_files":
            old = _as_slim_file_format(doc, table, slim)
        else:
            old = _with_json_metadata(doc, metadata)
        _record_path(d).write_text(json.dumps(old))
    for d in three:
        d.start()
    # "latest" finds the step whole, and every rank loads it bit for bit (other nodes' files
    # read through the share records their holders send, checked against the old digests).
    run_ranks(_load, 3, sockets)
    for d in three:
        assert "discarding" not in d.log()


def test_a_node_that_is_not_a_holder_keeps_no_share_table_and_loads_without_the_decider() -> None:
    """Four nodes, the decider and the next keep the share table: the two others keep only its
    digest, so their record does not grow with the number of nodes. With the decider stopped
    and one of those two replaced by an empty node, the survivors' ranks still find the step,
    restore the lost share from its replica and read the decider's share from its replica, bit
    for bit: the table from the holder left."""
    nodes = ring(4, token=TOKEN, replicas=1, prefix="tierckpt-test", capacity="256M")
    with running(nodes):
        # The ring (and the participants) in name order: each node's replica goes to the next.
        s0, s1, s2, s3 = sorted(nodes, key=lambda d: d.name)
        run_ranks(_save, 4, [str(d.socket) for d in (s0, s1, s2, s3)])  # rank 0: s0 decides
        records = {d.name: _record(d) for d in nodes}
        table = records[s0.name]["ring"]
        assert table["metadata_holders"] == [s0.name, s1.name]
        assert sorted(table["shares"]) == sorted(d.name for d in nodes)
        for d in (s2, s3):
            doc = records[d.name]
            assert "shares" not in doc["ring"] and not doc["metadata"]
            assert doc["ring"]["shares_digest"] == table["shares_digest"]
            # Of the ring, digests and the holders' names: nothing per node of the job.
            assert set(doc["ring"]) == {"shares_digest", "metadata_digest", "metadata_holders"}
        s0.kill()  # the decider is stopped (its share's replica is on s1)
        s2.lose_node()  # a node that is not a holder is replaced (its share's replica: on s3)
        s2.start()
        left = [s1, s2, s3]
        run_ranks(_load, 3, [str(d.socket) for d in left])
        with DaemonClient.from_socket(s2.socket) as c:
            assert c.step(NS, 5).files  # its share, restored from the peers
