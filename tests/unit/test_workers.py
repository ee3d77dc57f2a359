"""The uploader and the replicator through their seams, in one process: the Persister against a
real FileStore in tmp_path, the Replicator against an in-process stand-in for the peer network
(each "peer" a real TierService + PeerServer). The real-process versions of these stories are in
tests/integration/test_persistent_tier.py and test_replication.py."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt_core.errors import IntegrityError, NotFoundError, PersistentTierUnavailableError
from tierckpt_core.integrity import block_digest, checksum
from tierckpt_core.layout import durable_steps, read_step_manifest
from tierckpt_core.manifest import StepManifest
from tierckpt_core.metadata_blob import unpack_metadata
from tierckpt_core.objectstore import FileStore
from tierckpt_core.protocol import CommitRequest, PeerStep, SealFile, SealRequest, StepInfo
from tierckpt_daemon.peers.copier import Copier
from tierckpt_daemon.peers.fetch import PeerFetcher
from tierckpt_daemon.peers.membership import Membership, Ring
from tierckpt_daemon.peers.replication import Replicator
from tierckpt_daemon.peers.server import PeerServer
from tierckpt_daemon.tier.arena import Arena
from tierckpt_daemon.tier.persist import Persister
from tierckpt_daemon.tier.service import TierService

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


class PeerNetwork:
    """Routes PeerClient calls to in-process daemons by node name (no HTTP)."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[TierService, PeerServer, Replicator]] = {}

    def client(self) -> FakePeerClient:
        return FakePeerClient(self)


class FakePeerClient:
    def __init__(self, net: PeerNetwork) -> None:
        self.net = net

    def _server(self, peer: str) -> PeerServer:
        return self.net.nodes[peer][1]

    def list_steps(self, peer: str, namespace: str, **_: Any) -> list[PeerStep]:
        return self._server(peer).list_steps(namespace)

    def manifest(self, peer: str, namespace: str, step: int) -> StepManifest:
        return StepManifest.decode(
            self._server(peer).manifest(namespace, step).encode(), where=peer
        )

    def get_file(
        self, peer: str, namespace: str, step: int, attempt: str, name: str, path: str, length: int
    ) -> str:
        served = self._server(peer).open_file(namespace, step, attempt, name)
        try:
            assert served.length == length
            data = os.pread(served.fd, length, 0)
        finally:
            served.close()
        with open(path, "r+b") as f:
            f.write(data)
        return checksum(data)

    def get_file_blocks(
        self,
        peer: str,
        namespace: str,
        step: int,
        attempt: str,
        name: str,
        path: str,
        length: int,
        block_size: int,
        blocks: list[str],
        *,
        pace: Any = None,
    ) -> None:
        served = self._server(peer).open_file(namespace, step, attempt, name)
        try:
            data = os.pread(served.fd, length, 0)
        finally:
            served.close()
        got = [block_digest(data[o : o + block_size]) for o in range(0, length, block_size)]
        if got != blocks:
            raise IntegrityError(f"{namespace}/step {step}: {name} from {peer} is corrupt")
        with open(path, "r+b") as f:
            f.write(data)

    def pull(self, peer: str, namespace: str, step: int, origin: str, nbytes: int) -> StepInfo:
        return self.net.nodes[peer][2].pull_from(origin, namespace, step)

    def close(self) -> None:
        pass


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[PeerNetwork]:
    net = PeerNetwork()
    members = Membership.parse("a:1,b:1")
    for name in ("a:1", "b:1"):
        svc = _service(tmp_path / name.replace(":", "-"))
        client = net.client()
        ring = Ring(members, name)
        rep = Replicator(svc, ring, client, Copier(svc, client))  # type: ignore[arg-type]
        svc.replicas = 1
        svc.add_listener(rep)
        net.nodes[name] = (svc, PeerServer(svc), rep)
        rep.start()
    try:
        yield net
    finally:
        for _, _, rep in net.nodes.values():
            rep.stop()


def test_a_commit_is_replicated_to_the_ring_successor_verified(two_nodes: PeerNetwork) -> None:
    a, _, rep_a = two_nodes.nodes["a:1"]
    b, _, _ = two_nodes.nodes["b:1"]
    data = _save(a, 7)
    assert rep_a.wait_idle(20)
    assert a.get_step("job", 7).replicated_to == ["b:1"]
    replica = b.get_step("job", 7)
    assert replica.origin == "a:1" and replica.files[0].checksum == checksum(data)
    assert _read(b, 7) == data
    assert rep_a.status().replicated_steps == 1


def test_a_lost_node_restores_from_the_peer_and_a_corrupt_replica_is_refused(
    tmp_path: Path, two_nodes: PeerNetwork
) -> None:
    a, _, rep_a = two_nodes.nodes["a:1"]
    b, _, _ = two_nodes.nodes["b:1"]
    data = _save(a, 8)
    assert rep_a.wait_idle(20)
    # Node a is replaced: empty memory, same name.
    fresh = _service(tmp_path / "a-replaced")
    client = two_nodes.client()
    rep = PeerFetcher(
        fresh,
        client,  # type: ignore[arg-type]
        Ring(Membership.parse("a:1,b:1"), "a:1"),
        Copier(fresh, client),  # type: ignore[arg-type]
    )
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
    rep2 = PeerFetcher(
        other,
        client,  # type: ignore[arg-type]
        Ring(Membership.parse("a:1,b:1"), "a:1"),
        Copier(other, client),  # type: ignore[arg-type]
    )
    with pytest.raises(Exception, match=r"r0\.data.*corrupt"):
        rep2.hydrate("job", 8)
    with pytest.raises(NotFoundError):
        other.get_step("job", 8)
