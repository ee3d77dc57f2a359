"""The uploader and the replicator through their seams, in one process: the Persister against a
real FileStore in tmp_path, the Replicator and the PeerFetcher with real PeerClients against the
real peer routes of each node's daemon app, carried in process (tests/peer_kit.py). The real-process versions of these stories are in
tests/integration/test_persistent_tier.py and test_replication.py."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierckpt_core.errors import (
    NamespaceNotFoundError,
    NotFoundError,
    PeerUnavailableError,
    PersistentTierUnavailableError,
)
from tierckpt_core.integrity import checksum
from tierckpt_core.layout import durable_steps, read_step_manifest
from tierckpt_core.metadata_blob import unpack_metadata
from tierckpt_core.objectstore import FileStore
from tierckpt_core.protocol import CommitRequest, SealFile, SealRequest, StepInfo
from tierckpt_daemon.api.app import create_app
from tierckpt_daemon.config import DaemonSettings
from tierckpt_daemon.node import Node
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.copier import Copier
from tierckpt_daemon.peers.fetch import PeerFetcher
from tierckpt_daemon.peers.membership import Members, Membership, Ring
from tierckpt_daemon.peers.replication import Replicator
from tierckpt_daemon.tier import sealing
from tierckpt_daemon.tier.arena import Arena
from tierckpt_daemon.tier.persist import Persister
from tierckpt_daemon.tier.restore import Restorer
from tierckpt_daemon.tier.service import TierService

from peer_kit import InProcessPeers

MiB = 1 << 20


def _service(root: Path) -> TierService:
    svc = TierService(Arena(root, 64 * MiB), keep_last=3, lease_ttl_s=60, spares=False)
    svc.rebuild()
    return svc


def _save(svc: TierService, step: int, *, persist: bool | None = None) -> bytes:
    data = os.urandom(100_000)
    lease = svc.lease("job", 0, len(data))
    with open(lease.path, "r+b") as f:
        f.write(data)
    files = [SealFile(lease_id=lease.lease_id, name="r0.data", length=len(data))]
    svc.seal("job", step, f"a{step}", SealRequest(rank=0, files=files))
    req = CommitRequest(files=["r0.data"], metadata={"step": step}, world_size=1, persist=persist)
    svc.commit("job", step, f"a{step}", req)
    return data


def _read(svc: TierService, step: int) -> bytes:
    pin = svc.pin("job", step)
    try:
        with open(pin.paths["r0.data"], "rb") as f:
            return f.read(pin.step.files[0].length)
    finally:
        svc.unpin("job", step, pin.pin_id)


def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class FlakyStore(FileStore):
    """A FileStore whose uploads of chosen keys fail like a throttled S3 a number of times."""

    def __init__(self, root: Path, failures: dict[str, int]) -> None:
        super().__init__(root)
        self.failures = failures

    def put_file(self, key: str, path: str, length: int | None = None) -> str:
        for part, left in self.failures.items():
            if part in key and left > 0:
                self.failures[part] = left - 1
                raise PersistentTierUnavailableError(f"uploading {key}: 503 SlowDown")
        return super().put_file(key, path, length)


@pytest.fixture
def persisted(tmp_path: Path) -> Iterator[tuple[TierService, Persister, FlakyStore]]:
    svc = _service(tmp_path / "tier")
    store = FlakyStore(tmp_path / "store", {"step_000000000001/": 2})
    persister = Persister(svc, store, concurrency=2)
    persister.retry_base_s = 0.05
    svc.persistent = True
    svc.add_listener(persister)
    persister.start()
    try:
        yield svc, persister, store
    finally:
        persister.stop()


def test_uploads_are_durable_with_the_checksums_of_the_bytes(
    persisted: tuple[TierService, Persister, FlakyStore],
) -> None:
    svc, persister, store = persisted
    data = {step: _save(svc, step) for step in (1, 2)}
    assert persister.drain(30)
    assert durable_steps(store, "job") == [1, 2]
    for step, payload in data.items():
        manifest = read_step_manifest(store, "job", step)
        assert manifest.file("r0.data") is not None
        assert manifest.file("r0.data").checksum == checksum(payload)  # type: ignore[union-attr]
        assert unpack_metadata(manifest.metadata, where="test") == {"step": step}
        assert svc.get_step("job", step).state.value == "durable"
    status = persister.status()
    # Step 1 failed twice (throttled) and was retried while step 2 went ahead.
    assert (status.uploaded_steps, status.failed_uploads, status.queued_steps) == (2, 2, 0)
    assert status.healthy is True


def test_a_failing_upload_does_not_hold_up_the_steps_behind_it(tmp_path: Path) -> None:
    svc = _service(tmp_path / "tier")
    store = FlakyStore(tmp_path / "store", {"step_000000000001/": 1000})
    persister = Persister(svc, store)
    persister.retry_base_s = 0.05
    svc.persistent = True
    svc.add_listener(persister)
    persister.start()
    try:
        _save(svc, 1)
        _save(svc, 2)
        # Step 2 leaves the queue just after its marker is written: wait for both.
        _until(
            lambda: durable_steps(store, "job") == [2] and persister.status().queued_steps == 1
        )  # step 1, waiting for its next try
        status = persister.status()
        assert status.healthy is False and "503 SlowDown" in (status.last_error or "")
        assert svc.get_step("job", 1).state.value == "committed"  # still in memory
    finally:
        persister.stop()


def test_a_step_retired_while_its_upload_waits_for_a_retry_leaves_memory_at_the_next_sweep(
    tmp_path: Path,
) -> None:
    """Retention lets an older step due for upload go once a newer one is due; one retired while
    its upload waited for a retry kept its files in memory until that retry (a backoff of up to
    two minutes: the crash harness found one 35 s later). The next sweep lets it go now."""
    svc = TierService(Arena(tmp_path / "tier", 64 * MiB), keep_last=1, lease_ttl_s=60)
    svc.rebuild()
    store = FlakyStore(tmp_path / "store", {"step_000000000001/": 1000})
    persister = Persister(svc, store)
    persister.retry_base_s = 600.0  # its next try: ten minutes away
    svc.persistent = True
    svc.add_listener(persister)
    persister.start()
    try:
        _save(svc, 1)
        first = svc.index.committed["job"][1]
        _until(lambda: persister.failing() == 1 and not first.uploading)
        _save(svc, 2)  # due too, and the newest: step 1 leaves the committed steps
        assert svc.index.retiring == [first] and first.dir.exists()
        assert persister.wait_idle(30)  # step 2 uploaded; step 1 waits for its retry
        assert durable_steps(store, "job") == [2] and first.dir.exists()
        assert persister.status().healthy is False  # step 1's failure stands
        svc.sweep()
        _until(lambda: not first.dir.exists() and not svc.index.retiring, timeout=10)
        skips = svc.metrics.total(svc.metrics.upload_skips)
        assert skips == 1
        # Its failure no longer stands, and the tier took step 2 since: healthy (it stayed
        # unhealthy until some later upload, the alert firing meanwhile).
        status = persister.status()
        assert status.healthy is True and status.last_error is None, status
    finally:
        persister.stop()


def test_steps_retired_at_a_restart_with_their_upload_queued_leave_memory_at_the_sweep(
    tmp_path: Path,
) -> None:
    """A restart with more steps due than retention keeps: the older ones are retired at the
    rebuild, their uploads queued. Nothing asked the uploader about them (it starts with the
    committed steps): their files stayed for good. The next sweep lets them go."""
    root = tmp_path / "tier"
    before = TierService(Arena(root, 64 * MiB), keep_last=3, lease_ttl_s=60, spares=False)
    before.rebuild()
    before.persistent = True
    for step in (1, 2, 3):
        _save(before, step)  # due for upload; no uploader runs (the daemon dies)
    svc = TierService(Arena(root, 64 * MiB), keep_last=1, lease_ttl_s=60, spares=False)
    svc.rebuild()
    svc.persistent = True
    retired = sorted(r.step for r in svc.index.retiring)
    assert retired == [1, 2], retired  # step 3 is kept: the newest, and due
    store = FlakyStore(tmp_path / "store", {})
    persister = Persister(svc, store)
    svc.add_listener(persister)
    persister.start()
    try:
        assert persister.wait_idle(30)
        assert durable_steps(store, "job") == [3]
        svc.sweep()
        _until(
            lambda: (
                not svc.index.retiring and not (root / "ns" / "job" / "000000000001-a1").exists()
            )
        )
        assert svc.metrics.total(svc.metrics.upload_skips) == 2
    finally:
        persister.stop()


def test_hydrate_brings_a_durable_step_back_bit_exact(
    tmp_path: Path, persisted: tuple[TierService, Persister, FlakyStore]
) -> None:
    svc, persister, store = persisted
    data = _save(svc, 5)
    assert persister.drain(30)
    fresh = _service(tmp_path / "new-node")
    other = Persister(fresh, store)
    info = other.hydrate("job", 5)
    assert info.step == 5 and info.state.value == "durable"
    assert _read(fresh, 5) == data


class _QuietPeers:
    """A PeerSource whose listing no peer answered: a ring neighbour (``near``) or a peer
    farther on the ring (asked only where no neighbour knows the namespace)."""

    def __init__(self, near: bool) -> None:
        self.near = near

    def peer_steps(
        self,
        namespace: str,
        *,
        owner: str | None = None,
        silent: list[str] | None = None,
        near_silent: list[str] | None = None,
    ) -> dict[int, list[str]]:
        for out in (silent, near_silent if self.near else None):
            if out is not None:
                out.append("c:1 (no answer within 3 s)")
        return {}

    def hydrate(self, *args: object, **kwargs: object) -> StepInfo:
        raise AssertionError("not asked")


def test_nothing_found_while_a_neighbour_is_silent_is_not_a_first_start(tmp_path: Path) -> None:
    """The rule behind a restore's "latest" when no step is found: a silent ring neighbour may
    hold this node's steps (its replicas), so that is no first start (the trainer would train
    again from scratch); a silent peer farther on the ring, asked because no neighbour knows
    the namespace (every new job), blocks nothing. A listing is never blocked."""
    svc = _service(tmp_path / "tier")
    near = Restorer(svc, peers=_QuietPeers(near=True))
    with pytest.raises(PeerUnavailableError, match=r"c:1 \(no answer within 3 s\) did not answer"):
        near.newest_candidates("job")
    with pytest.raises(NamespaceNotFoundError):
        near.candidates("job", complete=True)  # (tierckpt ls: it names the silent peers)
    far = Restorer(svc, peers=_QuietPeers(near=False))
    with pytest.raises(NamespaceNotFoundError):
        far.newest_candidates("job")


TOKEN = "in-process-peer-token"
MEMBERS = "a:1,b:1"


class Peers:
    """Two daemons' parts, their peer routes served on an in-process network to real
    PeerClients (tests/peer_kit.py)."""

    def __init__(self, net: InProcessPeers, tmp_path: Path) -> None:
        self.net, self.tmp_path = net, tmp_path
        self.nodes: dict[str, tuple[TierService, Replicator]] = {}
        self._clients: list[PeerClient] = []
        self._nodes: list[Node] = []

    def client(self, name: str) -> PeerClient:
        client = PeerClient(
            TOKEN, members=Members(Membership.parse(MEMBERS), name), timeout_s=10, network=self.net
        )
        self._clients.append(client)
        return client

    def node(self, name: str) -> None:
        root = self.tmp_path / name.replace(":", "-")
        svc = _service(root)
        client = self.client(name)
        rep = Replicator(svc, Ring(Membership.parse(MEMBERS), name), client, Copier(svc, client))
        svc.replicas = 1
        svc.add_listener(rep)
        node = Node(svc, Restorer(svc), replicator=rep, client=client)
        settings = DaemonSettings(shm_dir=root, peers=MEMBERS, node_name=name, peer_token=TOKEN)
        self.net.add(name, create_app(node, settings))
        self.nodes[name] = (svc, rep)
        self._nodes.append(node)
        rep.start()

    def close(self) -> None:
        for node in self._nodes:
            node.close()
        for client in self._clients:
            client.close()


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[Peers]:
    with InProcessPeers() as net:
        peers = Peers(net, tmp_path)
        try:
            for name in ("a:1", "b:1"):
                peers.node(name)
            yield peers
        finally:
            peers.close()


def test_a_commit_is_replicated_to_the_ring_successor_verified(two_nodes: Peers) -> None:
    a, rep_a = two_nodes.nodes["a:1"]
    b, _ = two_nodes.nodes["b:1"]
    data = _save(a, 7)
    assert rep_a.wait_idle(20)
    assert a.get_step("job", 7).replicated_to == ["b:1"]
    replica = b.get_step("job", 7)
    assert replica.origin == "a:1" and replica.files[0].checksum == checksum(data)
    assert _read(b, 7) == data
    assert rep_a.status().replicated_steps == 1


def test_a_step_deleted_while_its_replica_waits_for_a_retry_leaves_memory_at_the_sweep(
    tmp_path: Path,
) -> None:
    """The replicator's side of the same rule as the uploader's: a step whose pushes fail
    (its successor is not there), deleted meanwhile, went only at its next retry."""
    with InProcessPeers() as net:
        peers = Peers(net, tmp_path)
        try:
            peers.node("a:1")  # b:1 never comes: every push fails
            a, rep = peers.nodes["a:1"]
            rep.retry_base_s = 600.0
            _save(a, 7)
            rec = a.index.committed["job"][7]
            _until(lambda: rep.failing() == 1)
            a.delete_step("job", 7)
            assert a.index.retiring == [rec] and rec.dir.exists()
            a.sweep()
            _until(lambda: not rec.dir.exists() and not a.index.retiring, timeout=10)
            assert a.metrics.total(a.metrics.replication_skips) == 1
        finally:
            peers.close()


def test_a_peer_that_refuses_a_replica_is_named_not_taken_for_down_and_gets_it_once_it_accepts(
    two_nodes: Peers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that answers and refuses a replica (as a daemon of an older version refused the
    block checksums of a newer client) was marked unreachable, as if it were down, with its
    refusal the only hint. It stays a member in good standing now, the WARNING says what it
    refused and what may be the cause, and the step goes once the peer accepts it."""
    a, rep_a = two_nodes.nodes["a:1"]
    b, _ = two_nodes.nodes["b:1"]
    refusal = "block size 262144 is not 16384 for 100000 bytes"
    monkeypatch.setattr(sealing, "check_digests", lambda *args: refusal)  # b's seal of the pull
    rep_a.retry_base_s = 600.0
    data = _save(a, 7)
    _until(lambda: rep_a.failing() == 1)
    assert rep_a.ring.seen()[1] == []  # not unreachable
    warned = [r.getMessage() for r in caplog.records if "refuses this node's replicas" in r.message]
    assert len(warned) == 1 and warned[0].startswith("peer b:1 refuses"), warned
    assert refusal in warned[0] and "tierckpt version" in warned[0]
    assert f"job/step 7: file r0.data: {refusal}" in (rep_a.status().last_error or "")
    monkeypatch.undo()  # b upgraded
    rep_a.hurry(a.index.committed["job"][7])
    _until(lambda: a.get_step("job", 7).replicated_to == ["b:1"])
    assert _read(b, 7) == data


def test_a_lost_node_restores_from_the_peer_and_a_corrupt_replica_is_refused(
    tmp_path: Path, two_nodes: Peers
) -> None:
    a, rep_a = two_nodes.nodes["a:1"]
    b, _ = two_nodes.nodes["b:1"]
    data = _save(a, 8)
    assert rep_a.wait_idle(20)
    # Node a is replaced: empty memory, same name.
    fresh = _service(tmp_path / "a-replaced")
    client = two_nodes.client("a:1")
    rep = PeerFetcher(fresh, client, Ring(Membership.parse(MEMBERS), "a:1"), Copier(fresh, client))
    assert rep.peer_steps("job") == {8: ["b:1"]}
    assert rep.hydrate("job", 8).step == 8
    assert _read(fresh, 8) == data
    # One flipped byte in b's replica: a restore elsewhere must refuse it, naming the file.
    pin = b.pin("job", 8)
    with open(pin.paths["r0.data"], "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    b.unpin("job", 8, pin.pin_id)
    other = _service(tmp_path / "a-again")
    rep2 = PeerFetcher(other, client, Ring(Membership.parse(MEMBERS), "a:1"), Copier(other, client))
    with pytest.raises(Exception, match=r"r0\.data.*corrupt"):
        rep2.hydrate("job", 8)
    with pytest.raises(NotFoundError):
        other.get_step("job", 8)


def test_files_whose_holders_fail_to_send_them_are_not_said_to_be_held_by_no_peer(
    tmp_path: Path, two_nodes: Peers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer holds the files, and its copy fails (a lossy link: the transfer timed out): the
    fetch said "no reachable peer holds r0.data" (StepNotFoundError, the CLI's exit 3), the
    peer's error dropped. It names the holder and why now, as the outage it is."""
    a, rep_a = two_nodes.nodes["a:1"]
    _save(a, 8)
    assert rep_a.wait_idle(20)
    fresh = _service(tmp_path / "a-replaced")
    client = two_nodes.client("a:1")
    copier = Copier(fresh, client)
    rep = PeerFetcher(fresh, client, Ring(Membership.parse(MEMBERS), "a:1"), copier)

    def lossy(peer: str, *args: object, **kwargs: object) -> None:
        raise PeerUnavailableError(f"peer {peer}: reading r0.data timed out after 30 s")

    monkeypatch.setattr(copier, "copy_from", lossy)
    with pytest.raises(PeerUnavailableError) as err:
        rep.fetch_files("job", 8, {"r0.data"})
    assert str(err.value) == (
        "job/step 8: r0.data could not be fetched from its holders (b:1: peer b:1: reading "
        "r0.data timed out after 30 s)"
    )


def test_a_range_handed_over_is_the_files_bytes(two_nodes: Peers) -> None:
    """``open_range`` (a hand-over to a trainer: the socket whose body comes next) through the
    real client and routes: the body is exactly the range asked for, after the response's head."""
    a, _ = two_nodes.nodes["a:1"]
    data = _save(a, 7)
    sock = two_nodes.client("b:1").open_range("a:1", "job", 7, "a7", "r0.data", 100, 5_000)
    assert isinstance(sock, socket.socket)  # plain HTTP: the connection itself, head read
    try:
        sock.settimeout(10)
        body = bytearray()
        while len(body) < 4_900:
            chunk = sock.recv(4_900 - len(body))
            assert chunk, f"the body ended after {len(body)} of 4900 bytes"
            body += chunk
    finally:
        sock.close()
    assert bytes(body) == data[100:5_000]
