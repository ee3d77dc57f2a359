"""Handing a local trainer a connection to a peer, so that a restore from a peer lands in the
trainer's tensors straight from the socket (see docs/design.md, "Restore straight from a peer").

A restore after a node loss used to have this daemon fetch the step from a peer into fresh tmpfs
pages (half its time went to allocating and writing them) and the trainer then copy it from there.
Now the trainer asks, on a second Unix socket beside the daemon's (:func:`handoff_socket`), for a
range of one file of a peer's step. This daemon dials the peer, sends the request with its own
peer token, reads and checks the response's head, and passes the connected socket to the trainer
(``SCM_RIGHTS``); the trainer reads the body into its tensors and checks every block against the
checksums of the step's manifest. The peer sends it by ``sendfile`` from its page cache.

Trust: the token never leaves this daemon (the request carrying it is sent before the hand-over,
and the peer closes the connection after the response, so the socket buys the trainer nothing but
those bytes). Only the configured peers are dialed, for names that pass the same checks as the
API's. The socket is 0660 in the directory of the daemon's API socket: whoever can reach one can
reach the other, and reading a step through the API needs no more: like the API's reads, a
request is served only for a copy of the caller's own uid (its credentials off the socket; the
copy's owner from the peer's listing, see tierckpt_daemon.tier.ownership). A TLS session
cannot change hands: with peer TLS the trainer gets one end of a socket pair instead, and this
daemon relays the decrypted body into the other (still no tmpfs pages on the way).

Protocol: one JSON line each way, :class:`tierckpt_core.handoff.HandoffRequest` and
:class:`~tierckpt_core.handoff.HandoffAnswer` (the connection attached to an ok answer).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from pathlib import Path

from tierckpt_core.errors import ProtocolError, StepNotFoundError, TierCkptError
from tierckpt_core.handoff import HandoffAnswer, HandoffRequest
from tierckpt_core.verified import CHUNK
from tierckpt_daemon.peers.bodies import RangeStream
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import Membership
from tierckpt_daemon.tier.ownership import owned_by
from tierckpt_daemon.tier.service import TierService
from tierckpt_daemon.tier.tenants import Caller, caller_of

logger = logging.getLogger(__name__)

MAX_REQUEST = 4096  # bytes of one request line
# For the trainer to send its whole request line (TIERCKPT_HANDOFF_TIMEOUT_S): one deadline, not
# a timeout per read, or a client sending a byte every few seconds would hold a slot for ever, and
# MAX_CONNECTIONS of them would block every restore on the node.
REQUEST_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 1.0  # at least, to take the one-line answer after the deadline
MAX_CONNECTIONS = 32  # served at once (relays included); more wait to be accepted
RELAY_TIMEOUT_S = 60.0  # for the trainer to take the next relayed piece
OWNERS_KEPT = 256  # owners of peers' copies remembered (a restore asks for many ranges of one)


class HandoffServer:
    """Serves hand-over requests on ``sock`` (a bound, listening Unix socket), one thread per
    connection, at most :data:`MAX_CONNECTIONS` at once; a request line not whole within
    ``request_timeout_s`` of the connection's acceptance is answered with an error and closed."""

    def __init__(
        self,
        sock: socket.socket,
        path: Path,
        *,
        service: TierService,
        client: PeerClient,
        membership: Membership,
        node: str,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        self.sock = sock
        self.path = path
        self.service = service
        self.client = client
        self.membership = membership
        self.node = node
        self.request_timeout_s = request_timeout_s
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        # (peer, namespace, step, attempt) -> the owner of that copy (see _check_owner)
        self._owners: dict[tuple[str, str, int, str], str | None] = {}
        self._owners_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="tierckpt-handoff", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("handing connections to peers to local trainers on %s", self.path)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._thread.is_alive():  # closed by its node, started or not
            self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            self._slots.acquire()
            try:
                conn, _ = self.sock.accept()
            except OSError:
                self._slots.release()
                if self._closed.is_set():
                    return
                logger.exception("handoff socket %s: accept failed", self.path)
                self._closed.wait(1.0)  # out of descriptors, say: not a busy loop
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="tierckpt-handoff-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                deadline = time.monotonic() + self.request_timeout_s
                try:
                    req = _request(conn, deadline, self.request_timeout_s)
                    peer = self._opened(req, caller_of(conn))
                except TierCkptError as e:
                    conn.settimeout(max(deadline - time.monotonic(), ANSWER_TIMEOUT_S))
                    _answer(conn, HandoffAnswer.failed(e))
                    return
                except OSError:  # the trainer's side: slow, or gone
                    raise
                except Exception as e:
                    logger.exception("handoff: serving a request failed")
                    conn.settimeout(ANSWER_TIMEOUT_S)
                    _answer(conn, HandoffAnswer(False, "internal", repr(e)))
                    return
                conn.settimeout(max(deadline - time.monotonic(), ANSWER_TIMEOUT_S))
                if isinstance(peer, socket.socket):  # plain TCP: the connection itself
                    with peer:
                        _answer(conn, HandoffAnswer(True), peer.fileno())
                    return
                # TLS: one end of a socket pair, the body relayed into the other
                ours, theirs = socket.socketpair()
                try:
                    with theirs:
                        _answer(conn, HandoffAnswer(True), theirs.fileno())
                    _relay(peer, ours)
                finally:
                    ours.close()
                    peer.close()
        except OSError as e:  # the trainer went away: nothing to tell anyone
            logger.debug("handoff: connection ended: %s", e)
        finally:
            self._slots.release()

    def _opened(self, req: HandoffRequest, caller: Caller | None) -> socket.socket | RangeStream:
        """The peer's answer to ``req``, its head read: the connection (plain TCP), or the body
        to relay (TLS); for the owner of the peer's copy only (as the API's reads)."""
        peer = req.peer
        members = set(self.membership.members()) - {self.node}
        if peer not in members:
            raise ProtocolError(
                f"handoff request: {peer!r} is not one of this daemon's peers "
                f"({', '.join(sorted(members)) or 'none'})"
            )
        self._check_owner(caller, peer, req.namespace, req.step, req.attempt)
        return self.client.open_range(
            peer, req.namespace, req.step, req.attempt, req.file, req.start, req.stop
        )

    def _check_owner(
        self, caller: Caller | None, peer: str, namespace: str, step: int, attempt: str
    ) -> None:
        """Refuse a caller a copy on ``peer`` that is not its uid's: NamespaceOwnerError if the
        namespace is another uid's here, StepNotFoundError if the copy is (or is not there)."""
        if caller is None:
            raise ProtocolError("handoff request: the daemon cannot tell which user is calling")
        service = self.service
        service.authorize(namespace, caller.identity, admin=caller.admin)
        wanted = service.acting_owner(namespace, caller.identity, admin=caller.admin)
        key = (peer, namespace, step, attempt)
        with self._owners_lock:
            known = key in self._owners
            owner = self._owners.get(key)
        if not known:  # one listing per copy, not per range
            copy = next(
                (
                    s
                    for s in self.client.list_steps(peer, namespace)
                    if s.step == step and s.attempt == attempt
                ),
                None,
            )
            if copy is None:
                raise StepNotFoundError(
                    f"{namespace}/step {step}: {peer} holds no attempt {attempt}"
                )
            owner = copy.owner
            with self._owners_lock:
                if len(self._owners) >= OWNERS_KEPT:
                    self._owners.pop(next(iter(self._owners)))
                self._owners[key] = owner
        if not owned_by(owner, wanted):
            raise StepNotFoundError(
                f"{namespace}/step {step} on {peer} belongs to {owner}, not to the caller "
                f"({caller.identity})"
            )


def _relay(body: RangeStream, out: socket.socket) -> None:
    """Copy a TLS peer's body into ``out`` (the trainer reads the other end)."""
    out.settimeout(RELAY_TIMEOUT_S)
    buf = memoryview(bytearray(min(CHUNK, body.length)))  # per read from a TLS peer
    left = body.length
    try:
        while left:
            n = body.readinto(buf[: min(len(buf), left)])
            out.sendall(buf[:n])
            left -= n
    except TierCkptError as e:  # the trainer sees the stream end early and says so
        logger.warning("handoff: relaying %s stopped: %s", body.what, e)


def _request(conn: socket.socket, deadline: float, timeout_s: float) -> HandoffRequest:
    data = bytearray()
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            conn.settimeout(left)
            chunk = conn.recv(MAX_REQUEST + 1 - len(data))
        except TimeoutError:
            raise ProtocolError(
                f"handoff request: no whole line within {timeout_s:g}s of connecting "
                "(TIERCKPT_HANDOFF_TIMEOUT_S)"
            ) from None
        if not chunk:
            raise ProtocolError("handoff request: the connection closed before a whole line")
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ProtocolError(f"handoff request: over {MAX_REQUEST} bytes")
    return HandoffRequest.from_line(data)


def _answer(conn: socket.socket, answer: HandoffAnswer, fd: int | None = None) -> None:
    line = answer.line()
    if fd is None:
        conn.sendall(line)
    else:
        socket.send_fds(conn, [line], [fd])
