"""A restore after a node loss, read by the trainer straight from the peers that hold the step into
its tensors, through connections its own daemon dials and hands over (``tierckpt_daemon.peers.handoff``),
each block verified as it lands; the daemon brings the step into memory afterwards. A bad copy on
one peer is read from the next; when every peer's copy is bad, the daemon's own restore (the
persistent tier) takes over. The handoff socket dials only the daemon's peers."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp.sources import streamed
from tierckpt_client.dcp.sources.peers import Handoff
from tierckpt_core.integrity import checksum
from tierckpt_core.protocol import handoff_socket

from helpers import DaemonProcess, ring, run_ranks, running, wait_until
from kit import seeded_state

pytestmark = pytest.mark.slow

TOKEN = "peer-token-for-the-direct-peer-tests-0123456789"
NS = "job"
N = 1_000_003  # float32: ~4 MiB, not a multiple of any block size


def _ring(n: int, **extra: Any) -> list[DaemonProcess]:
    return ring(n, token=TOKEN, **extra)


@pytest.fixture
def pair() -> Iterator[list[DaemonProcess]]:
    with running(_ring(2)) as nodes:
        yield nodes


def _config(d: DaemonProcess) -> ClientConfig:
    return ClientConfig.from_env(socket=d.socket)


# What each step saves: kit.seeded_state(step, **LAYOUT).
LAYOUT: dict[str, Any] = {
    "numel": N,
    "more": {"b": ((31,), torch.float32), "h": ((7, 300), torch.float16)},
    "note": "y" * 3000,
}


def _empty() -> dict[str, object]:
    return {
        "w": torch.zeros(N),
        "b": torch.zeros(31),
        "h": torch.zeros(7, 300, dtype=torch.float32),  # converted: through a private buffer
        "meta": {"step": -1, "note": ""},
    }


def _assert_state(out: dict[str, object], step: int) -> None:
    ref = seeded_state(step, **LAYOUT)
    assert torch.equal(out["w"], ref["w"])  # type: ignore[arg-type]
    assert torch.equal(out["b"], ref["b"])  # type: ignore[arg-type]
    assert torch.equal(out["h"], ref["h"].to(torch.float32))  # type: ignore[union-attr]
    assert out["meta"] == ref["meta"]


def _save_replicated(a: DaemonProcess, step: int, copies: int) -> None:
    writer = TieredStorageWriter(NS, step, config=_config(a))
    dcp.save(seeded_state(step, **LAYOUT), storage_writer=writer, no_dist=True)

    def replicated() -> bool:
        with DaemonClient(_config(a)) as c:
            info = c.step(NS, step)
        return len(info.replicated_to) == copies and not info.replication_pending

    wait_until(f"step {step} replicated to {copies} peers", replicated, 60)


def _reboot(d: DaemonProcess) -> None:
    d.kill()
    shutil.rmtree(d.shm_dir)
    d.start()


def _load(d: DaemonProcess) -> tuple[TieredStorageReader, dict[str, object]]:
    out = _empty()
    reader = TieredStorageReader(NS, config=_config(d))
    dcp.load(out, storage_reader=reader, no_dist=True)
    return reader, out


def _flip(d: DaemonProcess, offset: int) -> None:
    files = [p for p in (d.shm_dir / "ns" / NS).glob("*/r*") if p.is_file()]
    data = max(files, key=lambda p: p.stat().st_size)  # the tensors' file
    with open(data, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_replacement_node_reads_the_step_from_its_peer_into_the_tensors(
    pair: list[DaemonProcess], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    a, _ = pair
    _save_replicated(a, 3, 1)
    _reboot(a)
    # The file is ~4 MiB: split into several connections as a large one would be.
    monkeypatch.setattr(streamed, "SPLIT_MIN", 1)
    with caplog.at_level(logging.INFO, logger="tierckpt_client"):
        reader, out = _load(a)
    assert reader.resolved_step == 3
    _assert_state(out, 3)  # bit-exact
    assert "reading it straight from the peers that hold it" in caplog.text
    assert reader.fetched_bytes == reader.read_bytes > 4 * N
    # The load did not wait for this node's memory; the daemon fills it after.
    fill = reader.memory_fill
    assert fill is not None
    fill.join(60)
    with DaemonClient(_config(a)) as c:
        (cand,) = [x for x in c.candidates(NS) if x.step == 3]
    assert cand.in_memory
    caplog.clear()
    out = _empty()
    with caplog.at_level(logging.INFO, logger="tierckpt_client"):
        dcp.load(out, storage_reader=reader, no_dist=True)  # the same reader, again
    _assert_state(out, 3)
    assert reader.memory_fill is None  # from this node's memory now
    assert "straight from the peers" not in caplog.text


def test_with_restore_direct_off_the_daemon_brings_the_step_first(
    pair: list[DaemonProcess],
) -> None:
    a, _ = pair
    _save_replicated(a, 4, 1)
    _reboot(a)
    out = _empty()
    reader = TieredStorageReader(
        NS, config=ClientConfig.from_env(socket=a.socket, restore_direct="off")
    )
    dcp.load(out, storage_reader=reader, no_dist=True)
    _assert_state(out, 4)
    assert reader.memory_fill is None
    with DaemonClient(_config(a)) as c:
        assert [s.step for s in c.steps(NS)] == [4]  # in memory before the load read it


def test_a_bad_copy_on_one_peer_is_read_from_the_next(caplog: pytest.LogCaptureFixture) -> None:
    with running(_ring(3, replicas=2)) as (a, b, c):
        _save_replicated(a, 5, 2)
        _reboot(a)
        with DaemonClient(_config(a)) as client:
            first = next(iter(client.peer_sources(NS, 5).holders))
        bad = b if first == b.name else c
        _flip(bad, 3 * 16384 + 5)
        with caplog.at_level(logging.INFO, logger="tierckpt_client"):
            reader, out = _load(a)
        _assert_state(out, 5)
        assert f"from peer {first} does not match its checksum" in caplog.text
        assert "trying the next peer" in caplog.text
        assert reader.memory_fill is not None
        reader.memory_fill.join(60)


def test_when_every_peer_copy_is_bad_the_daemon_restores_from_the_persistent_tier(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    nodes = _ring(2, per_node=[{"persist_url": f"file://{tmp_path / 'store'}"}, {}])
    with running(nodes) as (a, b):
        _save_replicated(a, 6, 1)

        def durable() -> bool:
            with DaemonClient(_config(a)) as c:
                return c.step(NS, 6).state.value == "durable"

        wait_until("step 6 durable", durable, 60)
        _flip(b, 100)
        _reboot(a)
        with caplog.at_level(logging.INFO, logger="tierckpt_client"):
            reader, out = _load(a)
        assert reader.resolved_step == 6
        _assert_state(out, 6)
        assert "reading it from the peers failed" in caplog.text
        assert "does not match the checksum taken when it was written (block 0" in caplog.text
        assert "trying the persistent tier" in a.log()


def _ask(path: str, req: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(json.dumps(req).encode() + b"\n")
        data, fds, _, _ = socket.recv_fds(s, 4096, 1)
    return json.loads(data), fds


def test_the_handoff_socket_dials_only_peers_and_hands_over_just_the_range(
    pair: list[DaemonProcess],
) -> None:
    a, b = pair
    _save_replicated(a, 7, 1)
    _reboot(a)
    path = handoff_socket(a.socket)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660  # like the API socket
    with DaemonClient(_config(a)) as c:
        sources = c.peer_sources(NS, 7)
    peer = b.name
    assert sources.handoff and list(sources.attempts) == [peer]
    f = max(sources.manifest.files, key=lambda f: f.length)
    req = {
        "peer": peer,
        "namespace": NS,
        "step": 7,
        "attempt": sources.attempts[peer],
        "file": f.name,
        "start": 0,
        "stop": f.length,
    }
    handoff = Handoff(_config(a))
    # The connection carries exactly the range's bytes, then the peer closes it.
    with handoff.open(peer, NS, 7, sources.attempts[peer], f.name, 0, f.length) as sock:
        got = bytearray()
        while chunk := sock.recv(1 << 20):
            got += chunk
    assert len(got) == f.length and checksum(bytes(got)) == f.checksum
    # Anything but a peer of this daemon is refused before it dials: the peer token it would
    # send goes nowhere else.
    for host in ("127.0.0.1:9", "example.invalid:80", f"127.0.0.1:{a.settings['port']}"):
        doc, fds = _ask(str(path), {**req, "peer": host})
        assert fds == [] and not doc["ok"]
        assert "is not one of this daemon's peers" in doc["detail"]
    bad = [
        ({**req, "file": "../../etc/passwd"}, "file name"),
        ({**req, "attempt": "x\r\nHost: evil"}, "attempt"),
        ({**req, "start": 5, "stop": 5}, "bad range"),
        ({**req, "stop": "all"}, "must be integers"),
    ]
    for r, message in bad:
        doc, fds = _ask(str(path), r)
        assert fds == [] and not doc["ok"] and message in doc["detail"], doc
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(b"GET / HTTP/1.1\r\n\r\n\n")  # not the handoff protocol
        doc = json.loads(s.recv(4096))
    assert not doc["ok"] and "not JSON" in doc["detail"]
    # A range of a step the peer does not hold: the peer's own error, named.
    doc, fds = _ask(str(path), {**req, "step": 8})
    assert fds == [] and not doc["ok"] and doc["code"] in ("step_not_found", "not_found"), doc


# -- a step spanning nodes: what another node holds, read from it --------------------------------

BIG = 1 << 21  # float32 rows of 1: 8 MiB per rank, above what is fetched as small ranges


def _spanning(rank: int, world: int, sockets: list[str], numel: int = BIG) -> None:
    os.environ["TIERCKPT_SOCKET"] = sockets[rank]  # rank 0 on node A, rank 1 on node B
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(2 * numel, generator=torch.Generator().manual_seed(5))
    sd = {"w": distribute_tensor(full, mesh, [Shard(0)]), "meta": {"step": 9}}
    dcp.save(sd, storage_writer=TieredStorageWriter(NS, 9), process_group=dist.group.WORLD)


def test_a_rank_reads_what_another_node_holds_straight_from_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with running(_ring(2, replicas=0)) as (a, b):
        run_ranks(_spanning, 2, [str(a.socket), str(b.socket)])
        with DaemonClient(_config(b)) as c:
            held = {f.name for f in c.step(NS, 9).files}
        assert len(held) == 1  # node B holds its own rank's file only
        # One process on node B loads the whole tensor: node A's half is read from node A.
        out = {"w": torch.zeros(2 * BIG), "meta": {"step": -1}}
        reader = TieredStorageReader(NS, 9, config=_config(b))
        with caplog.at_level(logging.INFO, logger="tierckpt_client"):
            dcp.load(out, storage_reader=reader, no_dist=True)
        assert torch.equal(
            out["w"], torch.randn(2 * BIG, generator=torch.Generator().manual_seed(5))
        )
        assert out["meta"] == {"step": 9}
        assert "held by other nodes, from them straight into the tensors" in caplog.text
        assert reader.fetched_bytes >= 4 * BIG
        with DaemonClient(_config(b)) as c:
            assert {f.name for f in c.step(NS, 9).files} == held  # nothing copied into B


def test_a_file_that_reaches_the_readers_node_during_the_load_is_read_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small part of a file another node holds is fetched as ranges; when that file comes to
    this node between the load's pin and the fetch (a replica or another reader's hydration
    lands), the daemon refuses to send what it holds: the load pins again and reads it here."""
    small = 1000
    with running(_ring(2, replicas=0)) as (a, b):
        run_ranks(_spanning, 2, [str(a.socket), str(b.socket)], small)
        with DaemonClient(_config(b)) as c:
            held = {f.name for f in c.step(NS, 9).files}
        asked: list[str] = []
        fetch = DaemonClient.read_ranges

        def arrives_first(
            self: DaemonClient, namespace: str, step: int, name: str, ranges: list[Any]
        ) -> bytes:
            if not asked:  # the file lands on this node just before the first fetch
                self.hydrate(namespace, step, [name])
            asked.append(name)
            return fetch(self, namespace, step, name, ranges)

        monkeypatch.setattr(DaemonClient, "read_ranges", arrives_first)
        out = {"w": torch.zeros(2 * small), "meta": {"step": -1}}
        reader = TieredStorageReader(NS, 9, config=_config(b))
        dcp.load(out, storage_reader=reader, no_dist=True)
        assert asked  # the race happened: the first fetch found the file already here
        assert torch.equal(
            out["w"], torch.randn(2 * small, generator=torch.Generator().manual_seed(5))
        )
        assert out["meta"] == {"step": 9}
        with DaemonClient(_config(b)) as c:
            assert {f.name for f in c.step(NS, 9).files} > held
