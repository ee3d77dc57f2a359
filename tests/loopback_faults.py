"""Network faults on loopback, for tests that need a peer that is slow or unreachable rather
than dead (a dead daemon refuses connections at once; a real node that is cut off does not).

- :class:`SilentPeer`: a TCP listener that never answers. ``accept=True``: connections are
  accepted and held, so a request is sent and its answer never comes (a node whose packets are
  dropped after the connect). ``accept=False``: the accept queue is filled first, so later
  connects hang in SYN retransmits, as to a blackholed address.
- :class:`DelayProxy`: forwards one TCP endpoint to another, holding every chunk (and every end
  of a stream) ``delay_s`` in each direction: a link with latency, on which a server's close
  and a client's next request can cross. With ``cut_on``, the first request that contains those
  bytes is dropped and the link with it (a node blackholed from then on: nothing passes either
  way, connections are accepted and held, never answered).

Every thread here is a daemon thread that ends with :meth:`close`; every wait has a bound.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque
from typing import Any


class SilentPeer:
    """A listener on 127.0.0.1 that never answers; ``address`` is its ``host:port``."""

    def __init__(self, *, accept: bool = True) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        if accept:
            self._listener.listen(64)
            self._thread = threading.Thread(target=self._hold, daemon=True, name="silent-peer")
            self._thread.start()
        else:
            # Linux queues backlog + 1 completed connections; SYNs beyond that are dropped
            # (net.ipv4.tcp_abort_on_overflow=0), and the client retransmits them: a connect
            # hangs until its timeout.
            self._listener.listen(0)
            for _ in range(3):
                filler = socket.socket()
                filler.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    filler.connect(self._listener.getsockname())
                self._held.append(filler)
            time.sleep(0.2)  # let the handshakes that can complete complete

    def _hold(self) -> None:
        self._listener.settimeout(0.2)
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._held.append(conn)  # never read, never answered

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._held:
            s.close()

    def __enter__(self) -> SilentPeer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DelayProxy:
    """``127.0.0.1:<port>`` (``address``) forwarded to ``target`` with ``delay_s`` each way."""

    def __init__(self, target: str, delay_s: float, *, cut_on: bytes | None = None) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self.delay_s = delay_s
        self.cut_on = cut_on
        self.cut = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True, name="delay-proxy")
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.cut.is_set():
                self._socks.append(down)  # held, never answered
                continue
            try:
                up = socket.create_connection(self._target, timeout=5)
            except OSError:
                down.close()
                continue
            self._socks += [down, up]
            for src, dst, inbound in ((down, up, True), (up, down, False)):
                threading.Thread(
                    target=self._pipe, args=(src, dst, inbound), daemon=True, name="delay-pipe"
                ).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, inbound: bool) -> None:
        """Read ``src``; deliver each chunk (b"" = the end) to ``dst`` ``delay_s`` later."""
        queue: deque[tuple[float, bytes]] = deque()
        ready = threading.Condition()

        def deliver() -> None:
            while True:
                with ready:
                    while not queue:
                        if not ready.wait(1.0) and self._closed.is_set():
                            return
                    due, chunk = queue.popleft()
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    if not chunk:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(chunk)
                except OSError:  # the other end is gone: so is this direction
                    with contextlib.suppress(OSError):
                        src.shutdown(socket.SHUT_RDWR)
                    return

        sender = threading.Thread(target=deliver, daemon=True, name="delay-deliver")
        sender.start()
        while True:
            try:
                chunk = src.recv(1 << 16)
            except OSError:
                chunk = b""
            if inbound and self.cut_on is not None and self.cut_on in chunk:
                self.cut.set()
            if self.cut.is_set():  # blackholed: dropped, the end of the stream too
                if not chunk:
                    return
                continue
            with ready:
                queue.append((time.monotonic() + self.delay_s, chunk))
                ready.notify()
            if not chunk:
                return

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._socks:
            s.close()

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
