"""A small keep-alive HTTP/1.1 client for the daemon's Unix socket (what :class:`DaemonClient`
talks through).

Why not httpx: a restore from memory makes its requests on the trainer's critical path, and
httpx's layers (and ``http.client``'s header parsing) cost several times the CPU per request that
writing the request and reading the answer here does (docs/benchmarks.md, "Figures behind the
code's choices"). The socket is local
and speaks plain HTTP/1.1 to uvicorn, so little is needed: a pool of kept-alive connections (one
per caller at a time, so threads share a client), a timeout on every socket operation, and no
connection left to the garbage collector (a failed connect closes its socket: no ResourceWarning
in the trainer).

A connection idle for :data:`IDLE_EXPIRY_S` is closed rather than reused: uvicorn closes idle
connections after its keep-alive timeout (5 s by default), and a request sent on a connection the
server is closing fails. Connections the server has closed already (readable at EOF) are dropped
when taken; a request whose reused connection turns out closed before any answer came is sent
once more on a new one (the server closed it idle, so it never saw the request).

:meth:`UnixHTTP.send_later` sends a request and leaves its answer to be read later (a reader's
unpin, off the load's path): the daemon has the request before the call returns, and every later
request of this process, on any connection, first waits for those answers, so that what this
process asks next sees them served.
"""

from __future__ import annotations

import atexit
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import quote

# Below the daemon's keep-alive timeout (30 s; uvicorn's default of 5 s on daemons before it) with
# a margin: a connection the server may be about to close is never reused.
IDLE_EXPIRY_S = 2.0
_LINE_MAX = 65536
_URL_SAFE = "/?&=%:@+,;~!$'()*"

Answer = tuple[int, bytes]
Done = Callable[[Answer | None, BaseException | None], None]


class ConnectFailed(OSError):
    """The daemon's socket refused or did not accept a connection."""


class ServerClosed(ConnectionError):
    """The daemon closed the connection before it answered."""


class BadAnswer(ConnectionError):
    """The daemon's answer is not HTTP/1.1 as this client reads it."""


class _Conn:
    """One connection: a request written in one ``sendall``, the answer read from a buffer."""

    def __init__(self, path: str, connect_timeout: float) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(connect_timeout)
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise ConnectFailed(e.errno, e.strerror or str(e)) from None
        self.sock: socket.socket | None = sock
        self.rfile = sock.makefile("rb")
        self.idle_since = 0.0

    def close(self) -> None:
        if self.sock is not None:
            self.rfile.close()
            self.sock.close()
            self.sock = None

    def stale(self, now: float) -> bool:
        """Idle too long, or closed (or talking out of turn) on the server's side."""
        if self.sock is None or now - self.idle_since > IDLE_EXPIRY_S:
            return True
        # poll, not select: a trainer's process can hold descriptors above select's 1024.
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def put(self, method: str, url: str, body: bytes | None, timeout: float) -> None:
        assert self.sock is not None
        self.sock.settimeout(timeout)
        # Names in paths are validated to plain characters; anything else is escaped, never
        # allowed to break the request line.
        head = f"{method} {quote(url, safe=_URL_SAFE)} HTTP/1.1\r\nHost: tierckpt\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        elif method in ("POST", "PUT", "PATCH"):
            head += "Content-Length: 0\r\n"
        self.sock.sendall(head.encode("latin-1") + b"\r\n" + (body or b""))

    def get(self, timeout: float) -> Answer:
        """The answer to the request put last; the connection is closed after it unless the
        server keeps it alive."""
        assert self.sock is not None
        self.sock.settimeout(timeout)
        line = self.rfile.readline(_LINE_MAX)
        if not line:
            raise ServerClosed("the daemon closed the connection without an answer")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise BadAnswer(f"not an HTTP/1.1 status line: {line[:80]!r}")
        status = int(parts[1])
        length: int | None = None
        chunked = False
        close = parts[0] == b"HTTP/1.0"
        while True:
            header = self.rfile.readline(_LINE_MAX)
            if not header:
                raise ServerClosed("the daemon closed the connection mid-answer")
            if header in (b"\r\n", b"\n"):
                break
            name, _, value = header.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = _number(value, 10)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = value.strip().lower() == b"close"
        if status in (204, 304) or 100 <= status < 200:
            body = b""
        elif chunked:
            body = self._chunks()
        elif length is not None:
            body = self._exactly(length)
        else:  # the body runs to the end of the connection
            body, close = self.rfile.read(), True
        if close:
            self.close()
        return status, body

    def _exactly(self, n: int) -> bytes:
        data = self.rfile.read(n)
        if len(data) != n:
            raise ServerClosed(f"the daemon closed the connection {len(data)} of {n} bytes in")
        return data

    def _chunks(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size = _number(self.rfile.readline(_LINE_MAX).split(b";")[0], 16)
            if size == 0:
                while self.rfile.readline(_LINE_MAX) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            parts.append(self._exactly(size))
            self._exactly(2)  # CRLF


def _number(text: bytes, base: int) -> int:
    try:
        return int(text, base)
    except ValueError:
        raise BadAnswer(f"not a number in the answer's framing: {text[:40]!r}") from None


class _Owed:
    """A request sent by :meth:`UnixHTTP.send_later` whose answer is still to be read."""

    def __init__(self, http: UnixHTTP, conn: _Conn, timeout: float, done: Done) -> None:
        self.pid = os.getpid()
        self.http, self.conn, self.timeout, self.done = http, conn, timeout, done

    def collect(self, limit: float | None, report: bool) -> None:
        try:
            answer = self.conn.get(self.timeout if limit is None else min(limit, self.timeout))
        except OSError as e:
            self.conn.close()
            if report:
                self.done(None, e)
            return
        self.http._give(self.conn)
        if report:
            self.done(answer, None)


# Answers owed to this process (any socket, any client): collected before its next request.
_OWED: list[_Owed] = []
_OWED_LOCK = threading.Lock()


@atexit.register
def _at_exit() -> None:
    # Whatever the answers say, nobody is left to act on them (a daemon stopped before this
    # process is no news): wait for them, briefly, and drop them.
    collect_owed(limit=2.0, report=False)


def collect_owed(
    limit: float | None = None, *, report: bool = True, path: str | None = None
) -> None:
    """Read every answer owed to this process (blocking, each under its request's timeout, or
    ``limit``), and hand each to its request's ``done`` (``report``); with ``path``, only those
    of the daemon at that socket (a request to one daemon never waits on another's answers)."""
    if not _OWED:  # (the common case, without the lock)
        return
    pid = os.getpid()

    def taken(o: _Owed) -> bool:  # a forked child's copies are its parent's
        return o.pid == pid and (path is None or o.http.path == path)

    with _OWED_LOCK:
        mine = [o for o in _OWED if taken(o)]
        _OWED[:] = [o for o in _OWED if not taken(o)]
    for owed in mine:
        owed.collect(limit, report)


class UnixHTTP:
    """Requests to one Unix socket, on pooled keep-alive connections.

    Thread-safe: each request holds one connection for itself. Not fork-safe: a child makes its
    own (``DaemonClient`` keys its shared clients by process id)."""

    def __init__(self, path: str | os.PathLike[str], connect_timeout: float) -> None:
        self.path = str(path)
        self.connect_timeout = connect_timeout
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def request(self, method: str, url: str, body: bytes | None, timeout: float) -> Answer:
        """``(status, body)`` of the answer. Raises :class:`ConnectFailed` when no connection
        can be made, ``TimeoutError`` when an operation takes longer than ``timeout``, and
        another ``OSError`` when the connection fails."""
        collect_owed(path=self.path)
        conn, reused = self._send(method, url, body, timeout)
        try:
            try:
                answer = conn.get(timeout)
            except ServerClosed:
                if not reused:
                    raise
                # Closed idle by the server as the request came in: it never read it.
                conn.close()
                conn = self._put_new(method, url, body, timeout)
                answer = conn.get(timeout)
        except BaseException:
            conn.close()
            raise
        self._give(conn)
        return answer

    def send_later(
        self, method: str, url: str, body: bytes | None, timeout: float, done: Done
    ) -> None:
        """Send the request now; its answer (``(status, body)``, or the error) goes to ``done``
        when this process makes its next request, or exits. Raises as :meth:`request` when the
        request cannot be sent."""
        collect_owed(path=self.path)
        conn, _ = self._send(method, url, body, timeout)
        with _OWED_LOCK:
            _OWED.append(_Owed(self, conn, timeout, done))

    def _send(
        self, method: str, url: str, body: bytes | None, timeout: float
    ) -> tuple[_Conn, bool]:
        """The request sent, on a kept-alive connection (``True``) or a new one."""
        conn, reused = self._take()
        try:
            conn.put(method, url, body, timeout)
        except (BrokenPipeError, ConnectionResetError):
            conn.close()
            if not reused:
                raise
            # Closed idle by the server as the request went out: it never saw it.
            return self._put_new(method, url, body, timeout), False
        except BaseException:
            conn.close()
            raise
        return conn, reused

    def _put_new(self, method: str, url: str, body: bytes | None, timeout: float) -> _Conn:
        conn = _Conn(self.path, self.connect_timeout)
        try:
            conn.put(method, url, body, timeout)
        except BaseException:
            conn.close()
            raise
        return conn

    def _take(self) -> tuple[_Conn, bool]:
        now = time.monotonic()
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return _Conn(self.path, self.connect_timeout), False
            try:
                if not conn.stale(now):
                    return conn, True
            except BaseException:
                conn.close()
                raise
            conn.close()

    def _give(self, conn: _Conn) -> None:
        if conn.sock is None:
            return
        conn.idle_since = time.monotonic()
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections (those with an answer owed stay open until it is read)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = True
        for conn in idle:
            conn.close()
