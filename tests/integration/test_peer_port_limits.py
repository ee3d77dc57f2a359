"""What the TCP port takes before it knows who is calling: a peer route without the token is
refused from its headers alone, its body never read (a large one used to be read and parsed first,
hundreds of MiB of the daemon's memory, then refused); with the token, a body over its route's
cap is refused (413, naming the limit and the setting), whether it says its length or is sent in
chunks. Real daemons on real TCP ports; the client is a plain socket, so that what is sent and when
is exactly what the test says."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt_daemon.config import DaemonSettings

from helpers import DaemonProcess, free_port, ring, running, started

TOKEN = "peer-token-for-the-port-limit-tests-0123456789"
PREPARE = "/v1/peer/namespaces/job/steps/1/attempts/a1/prepare"
PULL = "/v1/peer/namespaces/job/steps/1/pull"
MiB = 1 << 20


@pytest.fixture
def node() -> Iterator[DaemonProcess]:
    with running(ring(1, token=TOKEN)) as nodes:
        yield nodes[0]


@pytest.fixture
def capped() -> Iterator[DaemonProcess]:
    """A daemon with small caps: 1 MiB for a commit record, 4 KiB for any other body."""
    with running(
        ring(1, token=TOKEN, peer_max_record_bytes="1M", peer_max_body_bytes="4K")
    ) as nodes:
        yield nodes[0]


def _connect(d: DaemonProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(d.settings["port"])), timeout=30)


def _head(path: str, *, length: int | None, token: str | None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines.append(
        f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    )
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer(s: socket.socket) -> tuple[int, dict[str, Any], http.client.HTTPMessage]:
    resp = http.client.HTTPResponse(s)
    resp.begin()
    body = resp.read()
    return resp.status, json.loads(body), resp.headers


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_large_body_without_the_token_is_refused_before_it_is_read(node: DaemonProcess) -> None:
    pid = node.pid
    with contextlib.suppress(OSError):  # the peak since now, not since the daemon started
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _status_kib(pid, "VmHWM")
    size = 200 * MiB
    filler = b'{"coordinator": "' + b"x" * (size - 19) + b'"}'
    assert len(filler) == size
    for token in (None, "wrong-token-of-the-right-length-000000"):
        with _connect(node) as s:
            # The head and the first MiB: the answer comes now, not after 200 MiB.
            s.sendall(_head(PREPARE, length=size, token=token) + filler[:MiB])
            status, doc, headers = _answer(s)
            assert status == 401, doc
            assert doc["code"] == "unauthorized" and "peer token" in doc["detail"]
            assert headers["www-authenticate"] == "Bearer"
            assert headers["connection"] == "close"
            # A client that goes on sending finds the connection closed: the rest is not read.
            sent = MiB
            with contextlib.suppress(OSError):
                view = memoryview(filler)
                while sent < size:
                    sent += s.send(view[sent : sent + 4 * MiB])
            assert sent < size, "the daemon took the whole body of a caller without the token"
    grown = (_status_kib(pid, "VmHWM") - before) * 1024
    assert grown < 64 * MiB, f"the daemon's peak RSS grew by {grown / MiB:.0f} MiB"
    # A local route over TCP is refused from its head too, and the connection closed.
    with _connect(node) as s:
        s.sendall(_head("/v1/namespaces/job/leases", length=size, token=None) + filler[:MiB])
        status, doc, headers = _answer(s)
    assert status == 403 and headers["connection"] == "close", doc
    # The routes still serve whoever has the token.
    with _connect(node) as s:
        s.sendall(_head(PULL, length=2, token=TOKEN) + b"{}")
        status, doc, _ = _answer(s)
    assert status == 422 and "origin" in doc["detail"], doc


def test_a_body_over_its_routes_cap_is_refused_with_the_token(capped: DaemonProcess) -> None:
    # Said in the head: refused before a byte of it is sent.
    for path, cap, setting in [
        (PREPARE, MiB, "TIERCKPT_PEER_MAX_RECORD_BYTES"),
        (PREPARE.replace("/prepare", "/commit"), MiB, "TIERCKPT_PEER_MAX_RECORD_BYTES"),
        (PULL, 4096, "TIERCKPT_PEER_MAX_BODY_BYTES"),
    ]:
        with _connect(capped) as s:
            s.sendall(_head(path, length=cap + 1, token=TOKEN))
            status, doc, headers = _answer(s)
        assert status == 413, doc
        assert doc["code"] == "protocol" and headers["connection"] == "close"
        assert f"limit of {cap} bytes" in doc["detail"] and setting in doc["detail"], doc
        assert f"({cap + 1} bytes)" in doc["detail"]
    # In chunks (no length said): counted as they arrive, cut off past the cap.
    chunk = b"x" * (64 << 10)
    with _connect(capped) as s:
        s.sendall(_head(PREPARE, length=None, token=TOKEN))
        for _ in range(MiB // len(chunk) + 1):
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, doc, _ = _answer(s)
    assert status == 413, doc
    assert f"limit of {MiB} bytes" in doc["detail"], doc
    assert "TIERCKPT_PEER_MAX_RECORD_BYTES" in doc["detail"]
    # Under the caps, with a length or in chunks, the route itself answers (here: no such
    # attempt is sealed on this node, or a pull's origin is not a peer).
    body = json.dumps(
        {
            "coordinator": "127.0.0.1:1",
            "participants": [],
            "files": ["f"] * 100_000,
            "world_size": 1,
        }
    ).encode()
    assert 256 << 10 < len(body) < MiB
    with _connect(capped) as s:
        s.sendall(_head(PREPARE, length=len(body), token=TOKEN) + body)
        status, doc, _ = _answer(s)
    assert status not in (401, 413) and status < 500, doc
    with _connect(capped) as s:
        s.sendall(_head(PULL, length=None, token=TOKEN))
        pull = json.dumps({"origin": "127.0.0.1:9"}).encode()
        s.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(pull), pull))
        status, doc, _ = _answer(s)
    assert status not in (401, 413) and status < 500, doc


def test_the_caps_are_settings_with_sizes(tmp_path: Path) -> None:
    s = DaemonSettings(shm_dir=tmp_path, peer_max_record_bytes="512M")
    assert s.peer_max_record_bytes == 512 * MiB
    assert s.peer_max_body_bytes == MiB  # the default: a pull is one short line
    assert DaemonSettings(shm_dir=tmp_path).peer_max_record_bytes == 256 * MiB
    with pytest.raises(ValueError, match="cannot parse size"):
        DaemonSettings(shm_dir=tmp_path, peer_max_body_bytes="lots")


@pytest.mark.parametrize("path", [PREPARE, PULL])
def test_a_peer_route_on_a_daemon_without_peers_is_refused_unread(path: str) -> None:
    port = free_port()
    with started(port=port, host="127.0.0.1") as alone, _connect(alone) as s:
        s.sendall(_head(path, length=100 * MiB, token=TOKEN))
        status, doc, _ = _answer(s)
    assert status == 403 and "replication is off" in doc["detail"], doc


def test_a_request_head_that_never_ends_is_cut_off_a_kept_alive_connection_is_not() -> None:
    """A client that sends a head a byte at a time, or never finishes it, held its connection
    (a descriptor, memory) for good, however many it opened. Now the head must be whole within
    TIERCKPT_HEAD_TIMEOUT_S of the connection's start or of the next request's first byte; an
    idle kept-alive connection between requests (a peer's pool) still lasts KEEPALIVE_S."""
    port = free_port()
    with started(port=port, host="127.0.0.1", head_timeout_s="1") as d:
        slow = [_connect(d) for _ in range(20)]
        for s in slow:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head, unfinished
        pooled = _connect(d)
        get = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        pooled.sendall(get)
        assert _answer(pooled)[0] == 200
        silent = _connect(d)  # connected, nothing sent
        for s in [*slow, silent]:
            s.settimeout(10)
            assert s.recv(1) == b"", "the daemon did not close a connection with no whole head"
            s.close()
        # 1 s of a head timeout has long passed: the pooled connection is idle, not cut off.
        pooled.sendall(get[:10])
        pooled.sendall(get[10:])
        assert _answer(pooled)[0] == 200
        # A next request begun and not finished is cut off like a first one.
        pooled.sendall(get[:10])
        pooled.settimeout(10)
        assert pooled.recv(1) == b""
        pooled.close()
