"""The one transport seam of :class:`~tierckpt_daemon.peers.client.PeerClient`: how a request to a
peer is carried, and the one place where what went wrong on the way becomes an error.

Three ways to carry one, each where it pays: a pooled ``httpx.Client`` for the JSON calls and small
ranges; an ``http.client`` connection for bulk bytes (its ``readinto`` fills a large buffer straight
from the socket, where httpx hands out 64 KiB pieces through h11: about a third of the
throughput); a raw socket (:meth:`Transport.dial`) for a response whose body a trainer reads
(:mod:`tierckpt_daemon.peers.handoff`). Each checks first that the peer is a current member of the
ring (NotAMemberError, nothing sent), each has ``timeout_s`` to connect and per read or write, and
each fails through :meth:`Transport.failures`: a transport error becomes
:class:`~tierckpt_core.errors.PeerUnavailableError` naming the peer and the request (retried), a
refused certificate :class:`PeerTLSError` (not retried: it will not fix itself); a peer's JSON
error maps back to its class by ``code`` (:func:`decode`).

A :class:`Network` carries the three ways somewhere other than this machine's TCP stack, as
httpx's ``MockTransport`` carries a client's requests: the tests' daemons in one process
(``tests/peer_kit.py``). Everything above stays this module's either way.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import ssl
from collections.abc import Iterator
from typing import Any, Protocol

import httpx
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from tierckpt_core.errors import PeerUnavailableError, TierCkptError
from tierckpt_core.http import decode_response
from tierckpt_core.retrying import log_before_retry
from tierckpt_daemon.peers.membership import Members
from tierckpt_daemon.peers.tls import PeerTLS, describe_tls_error

logger = logging.getLogger(__name__)

# A pooled connection idle this long is not used again. Well below the time a peer's server keeps
# an idle one (server.KEEPALIVE_S, 30 s; 5 s on daemons before it, uvicorn's default): a request
# must never be sent on a connection its server is closing (the two cross on the wire, and the
# request fails with no answer, as a dead peer's would).
KEEPALIVE_EXPIRY_S = 4.0

# What can go wrong on the way to a peer and back, on any of the three stacks.
TRANSPORT_ERRORS = (httpx.HTTPError, OSError, http.client.HTTPException)


class PeerTLSError(PeerUnavailableError):
    """A peer's certificate (or this daemon's, at the peer) was refused: not retried."""


class _HTTPSConnection(http.client.HTTPSConnection):
    """Checks the peer's certificate for ``server_name`` rather than the host it dials."""

    def __init__(
        self, host: str, *, timeout: float, context: ssl.SSLContext, server_name: str
    ) -> None:
        super().__init__(host, timeout=timeout, context=context)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP only (no proxy tunnel to peers)
        self.sock = self._context.wrap_socket(  # type: ignore[attr-defined]
            self.sock, server_hostname=self._server_name
        )


class Network(Protocol):
    """What carries requests to peers in place of TCP (plain HTTP only): one method per way.
    :class:`Transport` checks membership before it asks for any of them, and maps what they
    raise as it maps TCP's failures."""

    def http_transport(self) -> httpx.BaseTransport:
        """The transport of the pooled httpx client (JSON calls, small ranges)."""
        ...

    def connection(self, peer: str, timeout_s: float) -> http.client.HTTPConnection:
        """A connection to ``peer`` for bulk bytes (it connects on its first request)."""
        ...

    def dial(self, peer: str, timeout_s: float) -> socket.socket:
        """A connected stream socket to ``peer``, for a response a trainer reads."""
        ...


class Transport:
    def __init__(
        self,
        token: str,
        *,
        members: Members,
        timeout_s: float,
        tls: PeerTLS | None,
        network: Network | None = None,
    ) -> None:
        if network is not None and tls is not None:
            raise ValueError("a Network carries plain HTTP: it cannot be used with peer TLS")
        self.members = members
        self.timeout_s = timeout_s
        self.tls = tls
        self.network = network
        self.auth = f"Bearer {token}"
        self._scheme = "https" if tls is not None else "http"
        self._ssl = tls.client_context() if tls is not None else None
        self.http = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            headers={"Authorization": self.auth},
            limits=httpx.Limits(
                max_connections=64,
                max_keepalive_connections=16,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            verify=self._ssl if self._ssl is not None else True,
            trust_env=False,  # peers are dialed directly, never through a proxy from the env
            transport=network.http_transport() if network is not None else None,
        )

    def close(self) -> None:
        self.http.close()

    # -- the three ways ---------------------------------------------------------------------
    def url(self, peer: str, path: str) -> str:
        """For :attr:`http` (with :meth:`extensions`)."""
        self.members.require(peer, f"peer request {path}")
        return f"{self._scheme}://{peer}{path}"

    def extensions(self) -> dict[str, Any]:
        """The name the peer's certificate is checked for, when it is not the peer's host."""
        if self.tls is not None and self.tls.server_name:
            return {"sni_hostname": self.tls.server_name}
        return {}

    def connection(self, peer: str) -> http.client.HTTPConnection:
        self.members.require(peer, "peer request")
        if self.network is not None:
            return self.network.connection(peer, self.timeout_s)
        if self.tls is None or self._ssl is None:
            return http.client.HTTPConnection(peer, timeout=self.timeout_s)
        return _HTTPSConnection(
            peer,
            timeout=self.timeout_s,
            context=self._ssl,
            server_name=self.tls.expected_name(peer),
        )

    def dial(self, peer: str, path: str) -> socket.socket:
        """A plain TCP connection to ``peer`` (never with TLS: its session could not change hands)."""
        assert self.tls is None
        self.members.require(peer, f"peer request {path}")
        if self.network is not None:
            return self.network.dial(peer, self.timeout_s)
        addr = http.client.HTTPConnection(peer)  # parses host:port as requests to peers do
        return socket.create_connection((addr.host, addr.port), timeout=self.timeout_s)

    # -- failures ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def failures(self, peer: str, method: str, path: str) -> Iterator[None]:
        """Transport errors raised inside become :meth:`unavailable`'s error."""
        try:
            yield
        except TRANSPORT_ERRORS as e:
            raise self.unavailable(peer, method, path, e) from e

    def unavailable(
        self, peer: str, method: str, path: str, e: BaseException
    ) -> PeerUnavailableError:
        tls_problem = describe_tls_error(peer, e, self.tls)
        if tls_problem is not None:
            return PeerTLSError(f"{tls_problem} ({method} {path})")
        late = isinstance(e, httpx.TimeoutException | TimeoutError)
        what = "did not answer in time" if late else "failed"
        return PeerUnavailableError(
            f"peer {peer}: {method} {path} {what} ({type(e).__name__}: {e or 'no detail'})"
        )

    def retrying(self, attempts: int) -> Retrying:
        """Retries a transient failure (a peer unavailable, not a refused certificate)."""
        return Retrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=0.25, max=2.0),
            before_sleep=log_before_retry(logger, logging.INFO, attempts),
            reraise=True,
        )


def _transient(e: BaseException) -> bool:
    return isinstance(e, PeerUnavailableError) and not isinstance(e, PeerTLSError)


def decode(peer: str, method: str, path: str, status: int, body: bytes) -> Any:
    """The JSON of a peer's answer; its error (by ``code``) if it is one."""
    try:
        return decode_response(
            httpx.Response(status, content=body),
            f"peer {peer} answered {method} {path}",
            prefix=f"peer {peer}: ",
        )
    except TierCkptError as e:
        if type(e) is TierCkptError:  # an unexpected failure in the peer: maybe transient
            raise PeerUnavailableError(str(e)) from None
        raise
