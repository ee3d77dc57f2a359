"""Who the peers are, and where this node sits on the replication ring.

``TIERCKPT_PEERS`` is either a static list of every daemon's TCP endpoint (``host:port,...``, the
same list on every node) or ``dns:<name>:<port>``: the addresses of a Kubernetes headless Service,
resolved with ``getaddrinfo`` each time membership is needed, so pods that come and go are seen
without a restart.

The ring is the sorted set of members (this node included, even when DNS does not list it yet): every
node computes the same order from the same list, so node *i*'s replicas go to the *k* members after
it, and a replacement node with the same name finds its replicas on the same successors.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tierckpt_core.errors import (
    CheckpointFormatError,
    NotAMemberError,
    NotFoundError,
    PeerUnavailableError,
    ProtocolError,
    StepStateError,
    UnauthorizedError,
)

logger = logging.getLogger(__name__)

DNS_PREFIX = "dns:"

# Errors that make one peer a bad source or target for now; the next peer on the ring may do.
PEER_ERRORS = (
    PeerUnavailableError,
    UnauthorizedError,
    NotFoundError,
    StepStateError,
    ProtocolError,
    CheckpointFormatError,
)


def format_member(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_member(entry: str) -> tuple[str, int]:
    """Parse ``host:port`` or ``[v6]:port``; ValueError saying what is wrong otherwise."""
    text = entry.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"peer {entry!r}: use [ipv6]:port")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"peer {entry!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError(f"peer {entry!r}: use host:port (e.g. 10.0.0.7:8474)")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"peer {entry!r}: port {port_text!r} is not a number in 1..65535")
    if any(c.isspace() or c in "/?#@" for c in host):
        raise ValueError(f"peer {entry!r}: {host!r} is not a host name or address")
    return host, int(port_text)


def normalize_member(entry: str) -> str:
    host, port = split_member(entry)
    return format_member(host, port)


@dataclass(frozen=True)
class Membership:
    """The configured peers: a static list or a DNS name to resolve on every use."""

    static: tuple[str, ...] = ()
    dns: tuple[str, int] | None = None

    @classmethod
    def parse(cls, text: str) -> Membership:
        """Parse ``TIERCKPT_PEERS``; ValueError naming the bad entry."""
        text = text.strip()
        if text.startswith(DNS_PREFIX):
            host, port = split_member(text[len(DNS_PREFIX) :])
            return cls(dns=(host, port))
        entries = [e for e in (x.strip() for x in text.split(",")) if e]
        if not entries:
            raise ValueError("TIERCKPT_PEERS is empty: list host:port entries or dns:<name>:<port>")
        members = tuple(dict.fromkeys(normalize_member(e) for e in entries))
        return cls(static=members)

    def describe(self) -> str:
        if self.dns is not None:
            return f"dns:{format_member(*self.dns)}"
        return ",".join(self.static)

    def members(self) -> list[str]:
        """Every daemon's endpoint, sorted; resolves DNS now (blocking: call from a thread)."""
        if self.dns is None:
            return sorted(self.static)
        host, port = self.dns
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            raise PeerUnavailableError(
                f"cannot resolve the peers' DNS name {host} (TIERCKPT_PEERS): {e}"
            ) from e
        return sorted({format_member(str(info[4][0]), port) for info in infos})


class Members:
    """The current members of the ring: the one check made before the peer token leaves.

    The token is a cluster-wide key, so every request that carries it goes to a member, never to
    an address a request named (a trainer's commit, a peer's prepare). A static list is fixed;
    a DNS membership is resolved at most every ``refresh_s`` (and again when an address is not
    in the last answer, so a pod that just joined is found). Thread-safe.
    """

    def __init__(self, membership: Membership, node: str, *, refresh_s: float = 1.0) -> None:
        self.membership = membership
        self.node = node
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._known: frozenset[str] = frozenset(membership.static) | {node}
        self._resolved_at = -float("inf")

    def current(self, *, fresh: bool = False) -> frozenset[str]:
        """Every member, this node included (resolves DNS when the last answer is older than
        ``refresh_s``, or with ``fresh``: call from a thread). PeerUnavailableError when DNS
        cannot be resolved."""
        if self.membership.dns is None:
            return self._known
        with self._lock:
            if fresh or time.monotonic() - self._resolved_at > self.refresh_s:
                self._known = frozenset(self.membership.members()) | {self.node}
                self._resolved_at = time.monotonic()
            return self._known

    def is_member(self, peer: str) -> bool:
        """Whether ``peer`` is a member now (exactly as listed: the address that is dialed)."""
        if peer in self.current():
            return True
        with self._lock:
            recent = time.monotonic() - self._resolved_at <= self.refresh_s
        return not recent and peer in self.current(fresh=True)

    def require(self, peer: str, what: str) -> None:
        """NotAMemberError, naming ``peer`` and ``what`` wanted it, unless it is a member."""
        if not self.is_member(peer):
            raise NotAMemberError(
                f"{what}: {peer!r} is not a member of the ring ({self.membership.describe()}); "
                "the peer token goes only to members, so nothing was sent to it"
            )


def successors(members: Sequence[str], node: str) -> list[str]:
    """Every other member in ring order, starting after ``node`` (which need not be listed)."""
    ring = sorted(set(members) | {node})
    i = ring.index(node)
    return ring[i + 1 :] + ring[:i]


class Ring:
    """Where this node sits among its peers: the members after it in ring order (where its
    replicas go, and where a replaced node of the same name finds them), its neighbours (asked
    first by a restore), and which peers did not answer lately (the status shows them; a warning
    is logged once per outage). Thread-safe; one per daemon, shared by the replicator, the
    restore's fetcher and the status."""

    def __init__(self, membership: Membership, node: str, *, replicas: int = 1) -> None:
        self.membership = membership
        self.node = node
        self.replicas = replicas
        self._lock = threading.Lock()
        self._members: list[str] = [] if membership.dns else sorted(membership.static)
        self._unreachable: set[str] = set()

    def members(self) -> list[str]:
        """Every daemon's endpoint, sorted (resolves DNS now: call from a thread)."""
        return self.membership.members()

    def successors(self) -> list[str]:
        """The other members in ring order after this node (resolves DNS: call from a thread)."""
        members = self.membership.members()
        with self._lock:
            self._members = sorted(set(members) | {self.node})
        return successors(members, self.node)

    def neighbours(self, ring: list[str]) -> list[str]:
        """Of the other members in ring order, the ``replicas + 1`` after this node and as many
        before it."""
        k = max(1, self.replicas) + 1
        return list(dict.fromkeys(ring[:k] + ring[::-1][:k]))

    def peer_failed(self, peer: str, error: Exception) -> None:
        with self._lock:
            first = peer not in self._unreachable
            self._unreachable.add(peer)
        if first:  # once per outage, not once per retry
            logger.warning("peer %s: %s", peer, error)

    def peer_ok(self, peer: str) -> None:
        with self._lock:
            was_down = peer in self._unreachable
            self._unreachable.discard(peer)
        if was_down:
            logger.info("peer %s answers again", peer)

    def seen(self) -> tuple[list[str], list[str]]:
        """The members as last resolved (this node included) and the peers marked unreachable."""
        with self._lock:
            return list(self._members), sorted(self._unreachable)
