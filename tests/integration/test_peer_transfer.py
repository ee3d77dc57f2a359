"""A peer's file bytes as another daemon fetches them: by sendfile on a plain TCP connection
(``tierckpt_daemon.peers.zerocopy``), framed as ordinary HTTP, whole or in ranges, verified against the
checksums taken at writing (block by block for a file fetched in parallel ranges); a fetcher that
hangs up midway costs the serving daemon nothing."""

from __future__ import annotations

import http.client
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt_client import ClientConfig
from tierckpt_client.dcp import TieredStorageWriter
from tierckpt_core.errors import IntegrityError
from tierckpt_core.integrity import checksum
from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_daemon.peers import client as peer_client
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import Members, Membership

from helpers import DaemonProcess, free_port, new_shm_dir

TOKEN = "peer-token-for-the-transfer-tests-0123456789"
NS = "xfer"
N = 3 << 20  # float32 elements: a 12 MiB file, larger than any socket buffer


def _client(peer: str) -> PeerClient:
    """A peer client of a ring whose only member is ``peer`` (it sends the token nowhere else)."""
    return PeerClient(TOKEN, members=Members(Membership.parse(peer), peer), timeout_s=30)


@pytest.fixture
def served() -> Iterator[tuple[DaemonProcess, str, StepManifest, FileRecord]]:
    """A daemon holding one step with a 12 MiB file, its peer name, the step's manifest as a peer
    sees it, and the big file's record."""
    port = free_port()
    d = DaemonProcess(new_shm_dir(), port=port, peers=f"127.0.0.1:{port}", peer_token=TOKEN)
    try:
        d.start()
        state = {"w": torch.randn(N, generator=torch.Generator().manual_seed(7))}
        writer = TieredStorageWriter(NS, 1, config=ClientConfig.from_env(socket=d.socket))
        dcp.save(state, storage_writer=writer, no_dist=True)
        peer = f"127.0.0.1:{port}"
        client = _client(peer)
        try:
            manifest = client.manifest(peer, NS, 1)
        finally:
            client.close()
        big = max(manifest.files, key=lambda f: f.length)
        assert big.length > 4 * N - 1  # the tensor's bytes are in it
        yield d, peer, manifest, big
    finally:
        d.cleanup()


def _path(manifest: StepManifest, f: FileRecord) -> str:
    return f"/v1/peer/namespaces/{NS}/steps/1/attempts/{manifest.attempt}/files/{f.name}"


def _get(conn: http.client.HTTPConnection, path: str) -> http.client.HTTPResponse:
    conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
    return conn.getresponse()


def test_a_file_comes_whole_and_the_connection_carries_the_next_request(
    served: tuple[DaemonProcess, str, StepManifest, FileRecord],
) -> None:
    _, peer, manifest, big = served
    conn = http.client.HTTPConnection(peer, timeout=30)
    try:
        bodies = []
        for _ in range(2):  # twice on one keep-alive connection: the framing held
            resp = _get(conn, _path(manifest, big))
            assert resp.status == 200
            assert resp.getheader("content-length") == str(big.length)
            bodies.append(resp.read())
        # and a JSON answer after them on the same connection
        resp = _get(conn, f"/v1/peer/namespaces/{NS}/steps/1")
        assert resp.status == 200
        assert StepManifest.model_validate_json(resp.read()).attempt == manifest.attempt
    finally:
        conn.close()
    for body in bodies:
        assert len(body) == big.length
        assert checksum(body) == big.checksum  # the checksum the writer took


def test_every_file_fetched_into_a_local_file_matches_the_writers_checksums(
    served: tuple[DaemonProcess, str, StepManifest, FileRecord], tmp_path: Path
) -> None:
    _, peer, manifest, _ = served
    client = _client(peer)
    try:
        for f in manifest.files:
            dst = tmp_path / "dst"
            dst.write_bytes(b"\xff" * (f.length + 100))  # stale bytes: every byte is written
            assert manifest.attempt is not None
            got = client.get_file(peer, NS, 1, manifest.attempt, f.name, str(dst), f.length)
            assert got == f.checksum
            assert checksum(dst.read_bytes()[: f.length]) == f.checksum
    finally:
        client.close()


def test_a_fetcher_that_hangs_up_midway_leaves_the_daemon_serving(
    served: tuple[DaemonProcess, str, StepManifest, FileRecord],
) -> None:
    d, peer, manifest, big = served
    host, port = peer.rsplit(":", 1)
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            req = f"GET {_path(manifest, big)} HTTP/1.1\r\nHost: {peer}\r\n"
            s.sendall(f"{req}Authorization: Bearer {TOKEN}\r\n\r\n".encode())
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        # closed with most of the body unsent
    conn = http.client.HTTPConnection(peer, timeout=30)
    try:
        resp = _get(conn, _path(manifest, big))
        assert resp.status == 200
        assert checksum(resp.read()) == big.checksum
    finally:
        conn.close()
    log = d.log()
    assert "Exception in ASGI application" not in log
    assert "Traceback" not in log, log[-2000:]
    assert os.path.isdir(d.shm_dir)


def test_a_range_comes_as_206_with_exactly_those_bytes(
    served: tuple[DaemonProcess, str, StepManifest, FileRecord],
) -> None:
    _, peer, manifest, big = served
    conn = http.client.HTTPConnection(peer, timeout=30)
    try:
        whole = _get(conn, _path(manifest, big)).read()
        first, last = 1_000_003, big.length - 77  # not aligned to anything
        conn.request(
            "GET",
            _path(manifest, big),
            headers={"Authorization": f"Bearer {TOKEN}", "Range": f"bytes={first}-{last}"},
        )
        resp = conn.getresponse()
        assert resp.status == 206
        assert resp.getheader("content-range") == f"bytes {first}-{last}/{big.length}"
        assert resp.read() == whole[first : last + 1]
        for bad in (f"bytes={big.length}-{big.length + 5}", "bytes=5-", "lines=1-2", "bytes=9-3"):
            conn.request(
                "GET",
                _path(manifest, big),
                headers={"Authorization": f"Bearer {TOKEN}", "Range": bad},
            )
            resp = conn.getresponse()
            assert resp.status == 400, bad
            assert "Range" in resp.read().decode()
    finally:
        conn.close()
    assert checksum(whole) == big.checksum


def _tier_file(d: DaemonProcess, name: str) -> Path:
    found = [p for p in Path(d.shm_dir).rglob(name) if p.is_file() and not p.is_symlink()]
    assert len(found) == 1, found
    return found[0]


def test_a_large_file_comes_in_parallel_ranges_each_block_checked(
    served: tuple[DaemonProcess, str, StepManifest, FileRecord],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, peer, manifest, big = served
    assert manifest.attempt is not None and big.block_size and big.blocks
    monkeypatch.setattr(peer_client, "RANGE_MIN", 1)  # 12 MiB: 4 ranges
    dst = tmp_path / "dst"
    client = _client(peer)
    try:
        dst.write_bytes(b"\xff" * big.length)
        client.get_file_blocks(
            peer,
            NS,
            1,
            manifest.attempt,
            big.name,
            str(dst),
            big.length,
            big.block_size,
            big.blocks,
        )
        assert checksum(dst.read_bytes()) == big.checksum  # bit-exact: the writer's checksum
        # The peer's copy rots in one block: the fetch says which, and does not pass it off.
        corrupt = 5 * big.block_size + 123
        with open(_tier_file(d, big.name), "r+b") as f:
            f.seek(corrupt)
            byte = f.read(1)
            f.seek(corrupt)
            f.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(IntegrityError, match=r"\(block 5, bytes"):
            client.get_file_blocks(
                peer,
                NS,
                1,
                manifest.attempt,
                big.name,
                str(dst),
                big.length,
                big.block_size,
                big.blocks,
            )
    finally:
        client.close()
