"""Bodies of peers' answers, read the ways the daemon needs them: into a local tier file, whole
and checksummed (:func:`receive`; block by block, each checked as it lands, is
:func:`tierckpt_core.verified.receive_to`); the head of an answer off a raw socket without a byte
of its body, so that the socket can be handed to a trainer (:func:`read_head`); a TLS peer's body
to relay (:class:`RangeStream`). The heads of the answers to the one file route, whole
(:func:`check_whole`) or one range of it (:func:`check_range`), are checked here too.
:mod:`tierckpt_daemon.peers.client` makes the requests."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager

from tierckpt_core.errors import PeerUnavailableError, ProtocolError
from tierckpt_core.integrity import Hasher
from tierckpt_core.objectstore import pwriter
from tierckpt_core.verified import CHUNK
from tierckpt_daemon.peers.pacing import TokenBucket, paced_readinto
from tierckpt_daemon.peers.transport import decode

MAX_HEAD = 64 << 10  # bytes of a response's status line and headers


class RangeStream:
    """The body of a ranged answer from a TLS peer (:meth:`PeerClient.open_range`), to relay."""

    def __init__(
        self,
        conn: http.client.HTTPConnection,
        resp: http.client.HTTPResponse,
        length: int,
        what: str,
        failures: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self._conn = conn
        self._resp = resp
        self.length = length
        self.what = what
        self._failures = failures  # the transport's one translation of its errors

    def readinto(self, buf: memoryview) -> int:
        """Bytes of the body into ``buf``; PeerUnavailableError if it ends early."""
        with self._failures():
            n = self._resp.readinto(buf)
        if not n and len(buf):
            raise PeerUnavailableError(f"{self.what}: the body ended early")
        return n

    def close(self) -> None:
        self._conn.close()


def receive(
    resp: http.client.HTTPResponse,
    fd: int,
    length: int,
    what: str,
    pace: TokenBucket | None = None,
) -> str:
    """Read the ``length`` bytes of ``resp``'s body into the file ``fd`` (pwrite from one reused
    buffer, each piece checksummed while it is in the cache); their checksum.

    Not through a shared mapping of the file: on recycled pages that saved a fifth of this side's
    CPU time, but a file truncated under the mapping would kill the daemon with SIGBUS, and fresh
    tmpfs pages cost more by faults (zeroed first) than by pwrite (allocated as written).
    With ``pace``, read no faster than its rate (:mod:`tierckpt_daemon.peers.pacing`).
    """
    readinto = paced_readinto(resp.readinto, pace)
    h = Hasher()
    buf = memoryview(bytearray(min(CHUNK, max(length, 1))))
    put = pwriter(fd)
    off = 0
    while off < length:
        n = readinto(buf[: min(len(buf), length - off)])
        if not n:
            break
        h.update(buf[:n])
        put(buf[:n], off)
        off += n
    if off != length:
        raise PeerUnavailableError(f"{what} ended after {off} of {length} bytes")
    return h.hexdigest()


def recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise PeerUnavailableError(f"{what}: the connection closed mid-response")
        got += k
    return bytes(buf)


def read_head(sock: socket.socket, what: str) -> tuple[int, dict[str, str]]:
    """Read a response's status line and headers off ``sock``, and not one byte of its body
    (peeked first, then taken up to the blank line); the status and the headers, lowercased."""
    head = bytearray()
    while True:
        peeked = sock.recv(MAX_HEAD, socket.MSG_PEEK)
        if not peeked:
            raise PeerUnavailableError(f"{what}: the connection closed before the response")
        end = (bytes(head[-3:]) + peeked).find(b"\r\n\r\n")
        if end >= 0:
            head += recv_exact(sock, end + 4 - min(3, len(head)), what)
            break
        head += recv_exact(sock, len(peeked), what)
        if len(head) > MAX_HEAD:
            raise ProtocolError(f"{what}: the response's head is over {MAX_HEAD} bytes")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"{what}: not an HTTP/1 response ({lines[0][:80]!r})")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
    if "transfer-encoding" in headers:
        raise ProtocolError(f"{what}: a {headers['transfer-encoding']} body, not raw bytes")
    return int(parts[1]), headers


def check_whole(peer: str, url: str, resp: http.client.HTTPResponse, length: int) -> None:
    """The head of the answer to a GET of a whole file of ``length`` bytes."""
    if resp.status != 200:
        decode(peer, "GET", url, resp.status, resp.read())
        raise ProtocolError(f"peer {peer}: GET {url} answered HTTP {resp.status}")
    if resp.length is not None and resp.length != length:
        raise ProtocolError(
            f"peer {peer}: {url} is {resp.length} bytes, the manifest says {length}"
        )


def check_range(
    peer: str,
    url: str,
    start: int,
    stop: int,
    total: int | None,
    status: int,
    header: Callable[[str], str | None],
    body: Callable[[], bytes],
) -> None:
    """The head of the answer to a GET of bytes ``[start, stop)`` of a file (of ``total`` bytes,
    when known): 206, that range, that many bytes; else the peer's error, or ProtocolError."""
    what = f"peer {peer}: {url}"
    if status != 206:
        decode(peer, "GET", url, status, body())
        raise ProtocolError(f"{what} with a range answered HTTP {status}, not 206")
    got = header("content-range") or ""
    want = f"bytes {start}-{stop - 1}/"
    if (
        not got.startswith(want)
        or (total is not None and got != f"{want}{total}")
        or header("content-length") != str(stop - start)
    ):
        raise ProtocolError(
            f"{what} answered bytes {got!r} ({header('content-length')} bytes) for "
            f"{start}-{stop - 1}"
        )


def ask_range(sock: socket.socket, peer: str, url: str, auth: str, start: int, stop: int) -> None:
    """Ask ``peer`` on ``sock`` for bytes ``[start, stop)`` of ``url`` (``Connection: close``)
    and read and check the answer's head, without taking a byte of its body: the socket is then
    handed over whole (:meth:`PeerClient.open_range`)."""
    what = f"peer {peer}: {url}"
    sock.sendall(
        (
            f"GET {url} HTTP/1.1\r\nHost: {peer}\r\nAuthorization: {auth}\r\n"
            f"Range: bytes={start}-{stop - 1}\r\nConnection: close\r\n\r\n"
        ).encode()
    )
    status, headers = read_head(sock, what)
    n = min(int(headers.get("content-length", "0") or 0), MAX_HEAD)
    body = lambda: recv_exact(sock, n, what)  # noqa: E731
    check_range(peer, url, start, stop, None, status, headers.get, body)
