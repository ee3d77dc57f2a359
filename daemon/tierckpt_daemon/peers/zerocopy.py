"""File bytes to a peer without copying them through Python: ``os.sendfile`` from the tier file
to the socket, on plain TCP connections.

uvicorn gives an ASGI app no way to send a file but ``http.response.body`` messages, each a
``bytes`` read into Python, framed by h11 and copied into the transport's buffer, with a worker
thread hop per chunk for a blocking read: that path cost the serving daemon about as much CPU
as the loopback transfer itself (docs/benchmarks.md, "Figures behind the code's choices"). :class:`SendfileH11Protocol` (uvicorn's h11
protocol, as the daemon's ``http`` class) offers each request on a plain connection a
``tierckpt.sendfile`` scope extension, an awaitable ``(fd, offset, count)`` that hands the bytes to
``loop.sendfile`` (the kernel copies them from the page cache straight into the socket) and then
tells h11 they were sent (``Connection.send_with_data_passthrough`` with an object whose ``len``
is ``count``, as h11 documents for sendfile), so the response's framing stays h11's.
:class:`FileResponse` uses it when offered, and streams the bytes in large chunks otherwise (TLS
connections: the bytes must pass through the TLS layer).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

import anyio
import h11
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

logger = logging.getLogger(__name__)

EXTENSION = "tierckpt.sendfile"
STREAM_CHUNK = 4 << 20  # bytes per body message where sendfile is not offered (TLS)

SendFile = Callable[[int, int, int], Awaitable[None]]
"""``await sendfile(fd, offset, count)``: ``count`` bytes of ``fd`` from ``offset`` as response
body; OSError if the connection broke (the response is then incomplete and the connection closed)."""


class _Sent:
    """What h11 counts for ``count`` body bytes that went out by sendfile (its ``len``)."""

    __slots__ = ("count",)

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count


_CYCLE_PARTS = ("flow", "conn", "disconnected", "transport", "scope")  # what sendfile relies on


class SendfileH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, offering ``tierckpt.sendfile`` to requests on plain sockets."""

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None or self.transport.get_extra_info("sslcontext") is not None:
            return
        if not all(hasattr(cycle, a) for a in _CYCLE_PARTS):
            return  # a uvicorn whose request cycle differs: the bytes are streamed instead
        # The request's task is created but has not run yet: it sees the extension.
        scope = cast(dict[str, Any], cycle.scope)
        extensions = scope.setdefault("extensions", {})
        if EXTENSION not in extensions:
            extensions[EXTENSION] = _bind(self, cycle)


def _bind(protocol: SendfileH11Protocol, cycle: RequestResponseCycle) -> SendFile:
    async def sendfile(fd: int, offset: int, count: int) -> None:
        if cycle.disconnected or protocol.transport.is_closing():
            raise ConnectionResetError("the peer closed the connection")
        if cycle.flow.write_paused:
            await cycle.flow.drain()
        # loop.sendfile reads the file object's position only to restore it: a dup'ed fd keeps
        # the caller's own offset untouched.
        with open(os.dup(fd), "rb", buffering=0) as f:
            try:
                sent = await protocol.loop.sendfile(protocol.transport, f, offset, count)
            except BaseException:
                _cut(cycle)
                raise
        if sent != count:
            _cut(cycle)
            raise ConnectionResetError(f"sendfile sent {sent} of {count} bytes (the file shrank?)")
        cycle.conn.send_with_data_passthrough(h11.Data(data=_Sent(count)))  # type: ignore[arg-type]

    return sendfile


def _cut(cycle: RequestResponseCycle) -> None:
    """The body was cut short: the connection cannot carry another response."""
    cycle.transport.close()
    cycle.disconnected = True  # what uvicorn sets when the connection is lost


class FileResponse(Response):
    """``count`` bytes of the open file ``fd`` from ``offset``, by sendfile where the connection
    offers it, else in chunks read in a worker thread. ``total`` set: a 206 answer to a range
    request (``Content-Range``). ``done`` runs once the body is sent or the send failed (it closes
    the file and unpins it)."""

    def __init__(
        self,
        fd: int,
        count: int,
        done: Callable[[], None],
        *,
        offset: int = 0,
        total: int | None = None,
    ) -> None:
        super().__init__(media_type="application/octet-stream", status_code=200)
        self.headers["content-length"] = str(count)
        if total is not None:
            self.status_code = 206
            last = offset + count - 1
            self.headers["content-range"] = f"bytes {offset}-{last}/{total}"
        self.fd, self.offset, self.count, self.done = fd, offset, count, done

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            sendfile: SendFile | None = scope.get("extensions", {}).get(EXTENSION)
            if scope.get("method") == "HEAD":
                pass
            elif sendfile is not None and self.count:
                try:
                    await sendfile(self.fd, self.offset, self.count)
                except OSError as e:
                    logger.info("a peer's file transfer ended early: %s", e)
                    return
            else:
                await self._stream(send)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.done()

    async def _stream(self, send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        off, end = self.offset, self.offset + self.count
        while off < end:
            n = min(STREAM_CHUNK, end - off)
            chunk = await anyio.to_thread.run_sync(os.pread, self.fd, n, off)
            if not chunk:
                raise OSError(f"the file ended {end - off} bytes short of {end}")
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            off += len(chunk)


def parse_range(header: str | None, length: int) -> tuple[int, int] | None:
    """``(offset, count)`` of one ``Range: bytes=first-last`` (both given, inclusive) within a file
    of ``length`` bytes; None without a header. ValueError names what is wrong."""
    if header is None:
        return None
    unit, _, spec = header.strip().partition("=")
    first_s, dash, last_s = spec.strip().partition("-")
    if unit.strip().lower() != "bytes" or not dash or not first_s.isdigit() or not last_s.isdigit():
        raise ValueError(f"Range {header[:80]!r} is not one 'bytes=first-last' range")
    first, last = int(first_s), int(last_s)
    if first > last or last >= length:
        raise ValueError(f"Range {header[:80]!r} is outside the file's {length} bytes")
    return first, last - first + 1
