"""Run the daemon: one uvicorn server on the Unix socket (local clients) and the TCP port (probes,
metrics, peers); the TCP port speaks TLS when ``TIERCKPT_PEER_TLS_*`` is set (:mod:`.tls`)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import socket
import ssl
import stat
from pathlib import Path

import uvicorn

from tierckpt_core.protocol import handoff_socket
from tierckpt_daemon.api import create_app
from tierckpt_daemon.config import DaemonSettings
from tierckpt_daemon.node import Node, build_node
from tierckpt_daemon.peers.handoff import HandoffServer
from tierckpt_daemon.peers.zerocopy import SendfileH11Protocol
from tierckpt_daemon.tier.arena import check_root, make_dir
from tierckpt_daemon.tier.tenants import STATE_KEY, caller_of

logger = logging.getLogger(__name__)


# How long the daemon keeps an idle HTTP connection open. Its peers' clients let one go after
# KEEPALIVE_EXPIRY_S (peers/transport.py), well before: a request sent on a connection the server
# is closing meets a closed socket ("Server disconnected without sending a response") once the
# two ends' clocks are within the link's latency of each other (issue 32: certain at 4.95 s idle
# over a 25 ms link when both were uvicorn's and httpx's default of 5 s).
KEEPALIVE_S = 30


class CallerH11Protocol(SendfileH11Protocol):
    """The daemon's HTTP protocol: peers' file bytes by sendfile on plain TCP
    (:mod:`.peers.zerocopy`); on a Unix socket, each request carries its caller
    (:mod:`.tier.tenants`)."""

    head_timeout_s = 10.0  # TIERCKPT_HEAD_TIMEOUT_S: set by serve()
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        caller = caller_of(transport.get_extra_info("socket"))
        if caller is not None:
            self.app_state = {**self.app_state, STATE_KEY: caller}
        else:  # the TCP port: anyone who reaches it, before the token is checked
            self._await_head()

    # uvicorn bounds an idle kept-alive connection (KEEPALIVE_S) only until the first byte of
    # the next request, and the wait for the first request not at all: a client sending a head
    # a byte at a time (or never finishing it) held its connection for good. A request's head
    # must now be whole within head_timeout_s of the connection's start, or of the first byte
    # of the next request after an answer.
    def _await_head(self) -> None:
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _head_came(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        between = self.cycle is None or self.cycle.response_complete
        if between and self._head_deadline is None and self.app_state.get(STATE_KEY) is None:
            self._await_head()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a whole request head was parsed
            self._head_came()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_came()
        super().connection_lost(exc)


def _with_head_timeout(seconds: float) -> type[CallerH11Protocol]:
    return type("CallerH11Protocol", (CallerH11Protocol,), {"head_timeout_s": seconds})


class DaemonStartError(RuntimeError):
    """The daemon cannot start (another one runs on the same tier, a port is taken, ...)."""


class SettingError(DaemonStartError):
    """A setting the daemon cannot work with, found only when it is used (``__main__``: exit 2,
    the message names the setting)."""


def _lock_tier(shm_dir: Path) -> int:
    try:
        fd = os.open(shm_dir / "daemon.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o640)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DaemonStartError(
                f"{shm_dir / 'daemon.lock'} is a symbolic link; the daemon does not follow links "
                "in its tier directory: remove it"
            ) from None
        raise SettingError(
            f"TIERCKPT_SHM_DIR: cannot create files in {shm_dir}: {e.strerror or e}"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise DaemonStartError(
                f"another tierckpt daemon already serves {shm_dir}; stop it or use another "
                "TIERCKPT_SHM_DIR"
            ) from None
        raise
    return fd


def _bind_unix(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    st = os.stat(path.parent)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        logger.warning(
            "the socket's directory %s is writable by %s: whoever may write it could replace "
            "the daemon's socket with one of its own (every trainer of the node would talk to "
            "that process); use a directory only the daemon's user may write (TIERCKPT_SOCKET)",
            path.parent,
            "its group" if not st.st_mode & stat.S_IWOTH else "everyone",
        )
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # stale socket of a dead daemon: the tier lock says nobody else serves it
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # the socket is 0660 from its creation on, not after a chmod
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(128)
    return sock


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on connections whose
    # socket says it is TCP. With it on, each answer after the first on a kept-alive connection
    # (its head and body are two writes) waited for the peer's delayed ACK: 40 ms a round trip.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DaemonStartError(
            f"cannot listen on {host}:{port}: {e.strerror} (TIERCKPT_PORT)"
        ) from e
    sock.listen(128)
    return sock


def _handoff(settings: DaemonSettings, node: Node) -> HandoffServer | None:
    """Hand trainers connections to peers (or relays of them, with TLS) for restores straight
    into their tensors (see handoff); the node starts and closes it. Without the socket,
    restores from peers go through this daemon's memory, as before: a warning, not a reason to
    stop."""
    assert node.client is not None and node.ring is not None
    path = handoff_socket(settings.socket_path)
    try:
        sock = _bind_unix(path)
    except OSError as e:
        logger.warning(
            "cannot listen on %s (%s): restores from peers go through this daemon's memory",
            path,
            e,
        )
        return None
    return HandoffServer(
        sock,
        path,
        service=node.service,
        client=node.client,
        membership=node.ring.membership,
        node=node.ring.node,
        request_timeout_s=settings.handoff_timeout_s,
    )


class _Server(uvicorn.Server):
    """A uvicorn server whose TCP listeners speak TLS while its Unix socket does not (uvicorn's
    own ``ssl`` setting applies to every listener of a server alike)."""

    def __init__(
        self, config: uvicorn.Config, tls_sockets: list[socket.socket], tls: ssl.SSLContext
    ) -> None:
        super().__init__(config)
        self._tls_sockets = tls_sockets
        self._tls = tls

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        config, loop = self.config, asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            # What uvicorn's own startup builds for each connection.
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=loop,
            )

        for sock in self._tls_sockets:
            self.servers.append(
                await loop.create_server(protocol, sock=sock, ssl=self._tls, backlog=128)
            )


def serve(settings: DaemonSettings) -> None:
    try:
        make_dir(settings.shm_dir)
    except OSError as e:
        raise SettingError(
            f"TIERCKPT_SHM_DIR: cannot create {settings.shm_dir}: {e.strerror or e}"
        ) from None
    try:
        check_root(settings.shm_dir)
    except PermissionError as e:
        raise SettingError(f"TIERCKPT_SHM_DIR: {e}") from None
    lock_fd = _lock_tier(settings.shm_dir)
    node: Node | None = None
    restore_hook = None
    try:
        try:
            node = build_node(settings)
        except PermissionError as e:  # own_dir: a directory of the tier another user owns
            raise SettingError(f"TIERCKPT_SHM_DIR: {e}") from None
        restore_hook = node.failures.install()
        app = create_app(node, settings)
        try:
            sockets = [_bind_unix(settings.socket_path)]
        except OSError as e:
            raise SettingError(
                f"TIERCKPT_SOCKET: cannot listen on {settings.socket_path}: {e.strerror or e}"
            ) from None
        tcp = [_bind_tcp(settings.host, settings.port)] if settings.port else []
        tls = settings.peer_tls.server_context() if settings.peer_tls is not None else None
        if tls is None:
            sockets += tcp
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=30,
            timeout_keep_alive=KEEPALIVE_S,
            lifespan="on",
            # Peers' file bytes by sendfile on plain TCP; local callers' uid on the Unix socket.
            http=_with_head_timeout(settings.head_timeout_s),
        )
        server = uvicorn.Server(config) if tls is None else _Server(config, tcp, tls)
        if node.ring is not None:
            node.handoff = _handoff(settings, node)
        logger.info(
            "tierckpt daemon serving %s on %s%s (capacity %d bytes, keep_last %d, persistent "
            "tier %s, replication %s)",
            settings.shm_dir,
            settings.socket_path,
            f" and {settings.host}:{settings.port}{' (TLS)' if tls else ''}"
            if settings.port
            else "",
            settings.capacity_bytes,
            settings.keep_last,
            settings.persist_url or "none",
            f"to {settings.replicas} of peers {settings.peers} as {settings.node_name}"
            if settings.peers
            else "off",
        )
        asyncio.run(server.serve(sockets=sockets))
    finally:
        if restore_hook is not None:
            restore_hook()
        if node is not None:
            node.close()  # already closed at the app's shutdown, unless it never started
        with contextlib.suppress(FileNotFoundError):
            settings.socket_path.unlink()
        os.close(lock_fd)
