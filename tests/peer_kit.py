"""Daemons' peer routes in one process: an in-process network for the real ``PeerClient``.

:class:`InProcessPeers` is a ``tierckpt_daemon.peers.transport.Network``: it carries a
``PeerClient``'s requests to the daemon apps (``api.app.create_app``) registered under the peers'
names, with no TCP port, as httpx's ``MockTransport`` carries a client's requests. Everything
between the client's call and the app is the real code: the client's requests and their members
check, its error mapping and retries, the bodies' checks and each block's verification; in the
app, the port guard, the token gate, the routes and the file responses. What it stands in for is
the kernel's TCP and uvicorn's protocol: the pooled client's requests go to the app as ASGI calls
(an ``httpx.MockTransport``); the bulk-bytes and hand-over connections are one end of a socket
pair whose other end a kit thread serves (HTTP/1.1 through h11, the library uvicorn's protocol
uses). The apps run on one event loop (an anyio blocking portal), their sync routes in its worker
threads, as under uvicorn; an app's answer is held whole in memory before it is sent (test-sized
files). No lifespan runs: each test starts and stops the parts it builds.

Use: ``with InProcessPeers() as net: net.add("a:1", create_app(node, settings))``, and
``PeerClient(token, members=..., network=net)`` for each node.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from types import TracebackType
from typing import Any
from urllib.parse import unquote

import anyio
import anyio.from_thread
import h11
import httpx

logger = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
    Awaitable[None],
]
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]  # status, headers, body

JOIN_S = 10.0  # a serving thread outlives its connection by this much at most (at close)


class InProcessPeers:
    """A ``Network`` of daemon apps by peer name ("host:port"); a context manager."""

    def __init__(self) -> None:
        self.apps: dict[str, ASGIApp] = {}
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._threads: list[threading.Thread] = []
        self._died: list[BaseException] = []  # serving threads that died (raised at close)
        self._lock = threading.Lock()

    def __enter__(self) -> InProcessPeers:
        self._portal = self._portal_cm.__enter__()
        return self

    def __exit__(
        self, typ: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def add(self, peer: str, app: ASGIApp) -> None:
        """Serve ``app`` as the daemon at ``peer`` (its TCP port: the peer routes are open)."""
        self.apps[peer] = app

    def close(self) -> None:
        """Stop the event loop; raise if a connection's serving thread died."""
        if self._portal is None:
            return
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(JOIN_S)
        self._portal = None
        self._portal_cm.__exit__(None, None, None)
        alive = [t.name for t in threads if t.is_alive()]
        assert not alive, f"still serving after {JOIN_S}s: {alive}"
        if self._died:
            raise AssertionError(f"a serving thread died: {self._died[0]!r}") from self._died[0]

    # -- the Network's three ways ---------------------------------------------------------
    def http_transport(self) -> httpx.BaseTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            peer = f"{request.url.host}:{request.url.port}"
            timeout_s = request.extensions.get("timeout", {}).get("read")
            try:
                status, headers, body = self.call(
                    peer,
                    request.method,
                    request.url.raw_path,
                    request.headers.raw,
                    request.read(),
                    timeout_s,
                )
            except TimeoutError as e:  # as httpx's own transport says it
                raise httpx.ReadTimeout(str(e), request=request) from None
            return httpx.Response(status, headers=headers, content=body)

        return httpx.MockTransport(handle)

    def connection(self, peer: str, timeout_s: float) -> http.client.HTTPConnection:
        return _Connection(self, peer, timeout_s)

    def dial(self, peer: str, timeout_s: float) -> socket.socket:
        """One end of a socket pair; a thread serves the other as ``peer``'s daemon would."""
        if peer not in self.apps:
            raise ConnectionRefusedError(f"no daemon at {peer} in this process")
        ours, theirs = socket.socketpair()
        ours.settimeout(timeout_s)
        theirs.settimeout(timeout_s)
        t = threading.Thread(
            target=self._serve, args=(peer, theirs), name=f"peer-kit {peer}", daemon=True
        )
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()
        return ours

    # -- serving ----------------------------------------------------------------------------
    def call(
        self,
        peer: str,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeout_s: float | None,
    ) -> Answer:
        """One request to ``peer``'s app, as its TCP port would hand it over; TimeoutError if
        it has not answered in ``timeout_s`` (the caller's read timeout)."""
        app = self.apps.get(peer)
        if app is None:
            raise httpx.ConnectError(f"no daemon at {peer} in this process")
        assert self._portal is not None, "the network is closed"
        host, _, port = peer.rpartition(":")
        path, _, query = target.partition(b"?")
        scope: Message = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": unquote(path.decode("latin-1")),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": [(k.lower(), v) for k, v in headers],
            "server": (host, int(port)),  # a TCP port: api/app.py's guard serves peer routes
            "client": ("127.0.0.1", 0),
            "extensions": {},
        }
        answer = self._portal.start_task_soon(_asgi, app, scope, body)
        try:
            return answer.result(timeout_s)
        except concurrent.futures.TimeoutError:
            answer.cancel()
            raise TimeoutError(
                f"{peer}: {method} {scope['path']} did not answer in {timeout_s}s"
            ) from None

    def _serve(self, peer: str, sock: socket.socket) -> None:
        """HTTP/1.1 on ``sock`` for ``peer`` until the client closes it."""
        conn = h11.Connection(h11.SERVER)
        try:
            with sock:
                while True:
                    request, body = _read_request(conn, sock)
                    if request is None:
                        return
                    status, headers, data = self.call(
                        peer,
                        request.method.decode(),
                        request.target,
                        list(request.headers),
                        body,
                        sock.gettimeout(),
                    )
                    sock.sendall(conn.send(h11.Response(status_code=status, headers=headers)))
                    if request.method != b"HEAD" and data:
                        sock.sendall(conn.send(h11.Data(data=data)))
                    sock.sendall(conn.send(h11.EndOfMessage()))
                    if h11.MUST_CLOSE in (conn.our_state, conn.their_state):
                        return
                    conn.start_next_cycle()
        except OSError as e:  # the client went away mid-answer (it may: a range refused)
            logger.debug("peer kit: %s: connection ended: %s", peer, e)
        except BaseException as e:
            self._died.append(e)
            raise


class _Connection(http.client.HTTPConnection):
    """http.client's connection, its socket from :meth:`InProcessPeers.dial`."""

    def __init__(self, net: InProcessPeers, peer: str, timeout_s: float) -> None:
        super().__init__(peer, timeout=timeout_s)
        self._net, self._peer, self._timeout_s = net, peer, timeout_s

    def connect(self) -> None:
        self.sock = self._net.dial(self._peer, self._timeout_s)


def _read_request(conn: h11.Connection, sock: socket.socket) -> tuple[h11.Request | None, bytes]:
    """The next request on ``sock`` and its body; None when the client closed the connection."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(1 << 16))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None, b""


async def _asgi(app: ASGIApp, scope: Message, body: bytes) -> Answer:
    """Run one request through ``app``; its whole answer. An exception after the answer went
    out (starlette re-raises a route's crash after its 500) is logged, as uvicorn does."""
    answer: dict[str, Any] = {"status": None, "headers": [], "body": bytearray()}
    done = anyio.Event()
    sent_body = False

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    except Exception:
        if answer["status"] is None:
            raise
        logger.exception("peer kit: %s %s failed after its answer", scope["method"], scope["path"])
    assert answer["status"] is not None, f"{scope['method']} {scope['path']}: no answer"
    done.set()
    return answer["status"], answer["headers"], bytes(answer["body"])
