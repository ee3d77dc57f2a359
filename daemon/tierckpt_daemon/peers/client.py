"""HTTP client of the daemon-to-daemon routes (``/v1/peer/...`` on a peer's TCP port): what to ask
a peer; how it is carried, and how its failures become errors, is
:class:`~tierckpt_daemon.peers.transport.Transport`.

Thread-safe. Every call carries the shared token, so every call goes to a current member of the
ring and nowhere else (:class:`~tierckpt_daemon.peers.membership.Members`, checked where each URL
or connection is made: NotAMemberError, nothing sent), and has a timeout: ``timeout_s`` to connect
and for each read or write (a transfer that keeps moving may take longer in total; one that stalls
fails). Transport failures become :class:`PeerUnavailableError` naming the peer; a peer's JSON
errors map back to their classes by ``code``. Idempotent calls are retried a few times with
tenacity; a replication (``pull``) is retried by the replicator.

Bytes of a file come from one route, ``.../attempts/{attempt}/files/{name}``: whole (200), or one
range of it with ``Range: bytes=first-last`` (206): a large file in several streams at once
(:meth:`PeerClient.get_file_blocks`), a range handed to a trainer (:meth:`PeerClient.open_range`),
the blocks a reader on this node needs (:meth:`PeerClient.read_range`).

With :class:`~tierckpt_daemon.peers.tls.PeerTLS` every call is HTTPS: the peer's certificate must chain
to the CA and carry the peer's name (or the configured server name), and this daemon presents its
own; a refused certificate fails at once (no retry: it will not fix itself) with a message that
says which peer and why.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import logging
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tierckpt_core.errors import PeerUnavailableError, ProtocolError
from tierckpt_core.manifest import StepManifest
from tierckpt_core.objectstore import pwriter
from tierckpt_core.protocol import (
    DecideRequest,
    NodeStep,
    OutcomeResponse,
    PeerPullRequest,
    PeerStep,
    PrepareRequest,
    PrepareResponse,
    StepInfo,
)
from tierckpt_core.verified import BlockSums, receive_to
from tierckpt_daemon.peers.bodies import (
    MAX_HEAD,
    RangeStream,
    ask_range,
    check_range,
    check_whole,
    receive,
)
from tierckpt_daemon.peers.membership import Members
from tierckpt_daemon.peers.pacing import TokenBucket, paced_readinto
from tierckpt_daemon.peers.tls import PeerTLS
from tierckpt_daemon.peers.transport import Network, PeerTLSError, Transport, decode

logger = logging.getLogger(__name__)

__all__ = ["PeerClient", "PeerTLSError"]

RETRIES = 3
RANGE_STREAMS = 4  # connections at once for one large file: its receive copies and checksums
# then run on several cores, not one thread
RANGE_MIN = 64 << 20  # smaller files come in one stream


class PeerClient:
    def __init__(
        self,
        token: str,
        *,
        members: Members,
        timeout_s: float = 10.0,
        tls: PeerTLS | None = None,
        network: Network | None = None,
    ) -> None:
        """``network``: what carries the requests in place of TCP (tests: daemons in one
        process, ``tests/peer_kit.py``); membership, timeouts, errors and retries stay the
        client's."""
        self.members = members
        self.timeout_s = timeout_s
        self.tls = tls
        self._t = Transport(token, members=members, timeout_s=timeout_s, tls=tls, network=network)
        self._ranges = ThreadPoolExecutor(2 * RANGE_STREAMS, thread_name_prefix="tierckpt-range")
        # Told of every peer that answers a request with success (node.py: the ring's peer_ok):
        # a peer marked unreachable by one call stays so only until another call succeeds.
        self.answered: Callable[[str], None] = lambda peer: None

    def close(self) -> None:
        self._t.close()
        self._ranges.shutdown(wait=False, cancel_futures=True)

    # -- plumbing ---------------------------------------------------------------------------
    def _json(
        self,
        peer: str,
        method: str,
        path: str,
        *,
        attempts: int = RETRIES,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> Any:
        def once() -> Any:
            with self._t.failures(peer, method, path):
                resp = self._t.http.request(
                    method,
                    self._t.url(peer, path),
                    # A longer wait (a request relayed down a tree, a pull) is for the answer: a
                    # connect takes one peer timeout at most, whatever the request.
                    timeout=httpx.Timeout(timeout_s or self.timeout_s, connect=self.timeout_s),
                    extensions=self._t.extensions(),
                    **kwargs,
                )
            if resp.status_code < 400:
                self.answered(peer)
            return decode(peer, method, path, resp.status_code, resp.content)

        return self._t.retrying(attempts)(once)

    def _get(
        self, conn: http.client.HTTPConnection, url: str, span: tuple[int, int] | None = None
    ) -> http.client.HTTPResponse:
        """GET ``url`` on ``conn``: the whole file, or with ``span`` bytes ``[start, stop)`` of it
        (and ``Connection: close``: the connection ends with the range)."""
        headers = {"Authorization": self._t.auth}
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[1] - 1}"
            headers["Connection"] = "close"
        conn.request("GET", url, headers=headers)
        return conn.getresponse()

    # -- reads ------------------------------------------------------------------------------
    def list_steps(self, peer: str, namespace: str, *, timeout_s: float | None = None) -> Any:
        """The committed steps ``peer`` holds for ``namespace`` (one try: "latest" must not wait
        on a dead peer)."""
        doc = self._json(
            peer, "GET", f"/v1/peer/namespaces/{namespace}/steps", attempts=1, timeout_s=timeout_s
        )
        return [PeerStep.model_validate(x) for x in doc]

    def inventory(
        self, peer: str, namespace: str | None = None, *, timeout_s: float | None = None
    ) -> list[NodeStep]:
        """Every committed step ``peer`` holds in memory (of ``namespace``, if given); one try."""
        params = {"namespace": namespace} if namespace is not None else {}
        doc = self._json(
            peer, "GET", "/v1/peer/inventory", attempts=1, timeout_s=timeout_s, params=params
        )
        return [NodeStep.model_validate(x) for x in doc]

    def manifest(
        self, peer: str, namespace: str, step: int, *, metadata: bool = True
    ) -> StepManifest:
        """``peer``'s record of a step; ``metadata=False``: without its DCP metadata (a daemon
        from before that option sends it anyway)."""
        url = f"/v1/peer/namespaces/{namespace}/steps/{step}"
        params = {} if metadata else {"metadata": "false"}
        doc = self._json(peer, "GET", url, params=params)
        return StepManifest.model_validate(doc)

    def get_file(
        self,
        peer: str,
        namespace: str,
        step: int,
        attempt: str,
        name: str,
        path: str,
        length: int,
        *,
        pace: TokenBucket | None = None,
    ) -> str:
        """Stream one file of ``peer``'s step into the local file ``path`` (written in place, no
        second buffer); return the checksum of the bytes received. The caller verifies it.
        ``pace``: no faster than that bucket allows (shared with the daemon's other transfers)."""
        url = _file_url(namespace, step, attempt, name)

        def once() -> str:
            conn = self._t.connection(peer)
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            resp: http.client.HTTPResponse | None = None
            try:
                with self._t.failures(peer, "GET", url):
                    resp = self._get(conn, url)
                    check_whole(peer, url, resp, length)
                    return receive(resp, fd, length, f"peer {peer}: {url}", pace)
            finally:
                if resp is not None:  # a body left unread keeps the socket open until closed
                    resp.close()
                os.close(fd)
                conn.close()

        return self._t.retrying(RETRIES)(once)

    def get_file_blocks(
        self,
        peer: str,
        namespace: str,
        step: int,
        attempt: str,
        name: str,
        path: str,
        length: int,
        block_size: int,
        blocks: list[str],
        *,
        pace: TokenBucket | None = None,
    ) -> None:
        """Fetch one file of ``peer``'s step into the local file ``path`` in up to
        ``RANGE_STREAMS`` ranges at once (one connection each, whole blocks), checking every
        block against ``blocks`` (the writer's checksums) as it arrives, while it is in the cache.
        BlockMismatchError (an IntegrityError) names the first block that does not match. A peer
        that does not answer ranges sends the whole file in one stream, checked the same way.
        ``pace``: all streams together no faster than that bucket allows."""
        if block_size <= 0 or len(blocks) != -(-length // block_size):
            raise ProtocolError(
                f"peer {peer}: {name} has {len(blocks)} block checksums of {block_size} bytes "
                f"for {length} bytes"
            )
        url = _file_url(namespace, step, attempt, name)
        sums = BlockSums(
            name,
            length,
            block_size,
            blocks,
            where=f"{namespace}/step {step}",
            source=f"in peer {peer}",
            remedy="that copy is corrupt",
        )
        per = max(1, -(-len(blocks) // RANGE_STREAMS) if length >= RANGE_MIN else len(blocks))
        parts = [(b, min(b + per, len(blocks))) for b in range(0, len(blocks), per)]

        def part(first: int, end: int, whole: bool) -> bool:
            """Blocks [first, end) (``whole``: all of them, asked without a range); False if the
            peer sent the whole file for a range (it does not answer ranges)."""
            start, stop = first * block_size, min(end * block_size, length)

            def once() -> bool:
                conn = self._t.connection(peer)
                fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
                resp: http.client.HTTPResponse | None = None
                try:
                    with self._t.failures(peer, "GET", url):
                        resp = self._get(conn, url, None if whole else (start, stop))
                        if whole:
                            check_whole(peer, url, resp, length)
                        elif resp.status == 200:
                            return False
                        else:
                            check_range(
                                peer,
                                url,
                                start,
                                stop,
                                length,
                                resp.status,
                                resp.getheader,
                                resp.read,
                            )
                        readinto = paced_readinto(resp.readinto, pace)
                        receive_to(
                            lambda view, _at: readinto(view),
                            pwriter(fd),
                            sums,
                            start,
                            stop,
                            short=PeerUnavailableError,
                        )
                        return True
                finally:
                    if resp is not None:  # a body left unread keeps the socket open until closed
                        resp.close()
                    os.close(fd)
                    conn.close()

            return bool(self._t.retrying(RETRIES)(once))

        if len(parts) > 1:
            futures = [self._ranges.submit(part, a, b, False) for a, b in parts]
            concurrent.futures.wait(futures)  # none may still write into the file after this
            if all([fut.result() for fut in futures]):  # raises the first failure
                return
            logger.info("peer %s does not answer ranges: fetching %s in one stream", peer, name)
        part(0, len(blocks), True)

    def open_range(
        self, peer: str, namespace: str, step: int, attempt: str, name: str, start: int, stop: int
    ) -> socket.socket | RangeStream:
        """Bytes ``[start, stop)`` of file ``name`` of ``peer``'s step, unverified (for
        :mod:`tierckpt_daemon.peers.handoff`: the trainer it hands them to checks each block). The
        request is sent (with this daemon's token, ``Connection: close``) and the response's head
        read and checked (206, the range asked for, its length). On plain TCP: the connection,
        on which the body comes next (its head was read without taking a byte of the body), to
        be handed over whole. With TLS, whose session cannot change hands: a
        :class:`RangeStream` to relay."""
        url = _file_url(namespace, step, attempt, name)
        if not 0 <= start < stop:
            raise ProtocolError(f"peer {peer}: {url}: empty or negative range {start}-{stop}")
        what = f"peer {peer}: {url}"

        def plain() -> socket.socket:
            with self._t.failures(peer, "GET", url):
                sock = self._t.dial(peer, url)
                try:
                    ask_range(sock, peer, url, self._t.auth, start, stop)
                    return sock
                except BaseException:
                    sock.close()
                    raise

        def tls() -> RangeStream:
            conn = self._t.connection(peer)
            resp: http.client.HTTPResponse | None = None
            try:
                with self._t.failures(peer, "GET", url):
                    resp = self._get(conn, url, (start, stop))
                    body = lambda: resp.read(MAX_HEAD)  # noqa: E731
                    check_range(peer, url, start, stop, None, resp.status, resp.getheader, body)
                    failures = lambda: self._t.failures(peer, "GET", url)  # noqa: E731
                    return RangeStream(conn, resp, stop - start, what, failures)
            except BaseException:
                if resp is not None:
                    resp.close()
                conn.close()
                raise

        once: Callable[[], socket.socket | RangeStream] = plain if self.tls is None else tls
        return self._t.retrying(RETRIES)(once)

    def read_range(
        self,
        peer: str,
        namespace: str,
        step: int,
        attempt: str,
        name: str,
        offset: int,
        length: int,
    ) -> bytes:
        """``length`` bytes at ``offset`` of file ``name`` of ``peer``'s copy ``attempt`` of a
        step (unverified: the caller checks them against the block checksums); a ranged GET on
        the pooled connections (small reads: no connection of their own)."""
        url = _file_url(namespace, step, attempt, name)
        if not 0 <= offset < offset + length:
            raise ProtocolError(f"peer {peer}: {url}: empty or negative range {offset}+{length}")

        def once() -> bytes:
            with self._t.failures(peer, "GET", url):
                resp = self._t.http.get(
                    self._t.url(peer, url),
                    headers={"Range": f"bytes={offset}-{offset + length - 1}"},
                    extensions=self._t.extensions(),
                )
            check_range(
                peer,
                url,
                offset,
                offset + length,
                None,
                resp.status_code,
                resp.headers.get,
                lambda: resp.content,
            )
            if len(resp.content) != length:
                raise PeerUnavailableError(
                    f"peer {peer}: {url} sent {len(resp.content)} of {length} bytes"
                )
            return resp.content

        return self._t.retrying(RETRIES)(once)

    # -- commits across nodes ---------------------------------------------------------------
    def _attempt_path(self, namespace: str, step: int, attempt: str) -> str:
        return f"/v1/peer/namespaces/{namespace}/steps/{step}/attempts/{attempt}"

    def prepare(
        self,
        peer: str,
        namespace: str,
        step: int,
        attempt: str,
        req: PrepareRequest,
        *,
        timeout_s: float | None = None,
    ) -> PrepareResponse:
        doc = self._json(
            peer,
            "POST",
            self._attempt_path(namespace, step, attempt) + "/prepare",
            attempts=1,
            timeout_s=timeout_s,
            json=req.model_dump(mode="json"),
        )
        return PrepareResponse.model_validate(doc)

    def decide(
        self,
        peer: str,
        req: DecideRequest,
        *,
        timeout_s: float | None = None,
        attempts: int = RETRIES,
    ) -> StepInfo:
        m = req.manifest
        assert m.attempt is not None
        doc = self._json(
            peer,
            "POST",
            self._attempt_path(m.namespace, m.step, m.attempt) + "/commit",
            attempts=attempts,
            timeout_s=timeout_s,
            json=req.model_dump(mode="json"),
        )
        return StepInfo.model_validate(doc)

    def abort(self, peer: str, namespace: str, step: int, attempt: str) -> None:
        self._json(peer, "POST", self._attempt_path(namespace, step, attempt) + "/abort")

    def outcome(self, peer: str, namespace: str, step: int, attempt: str) -> OutcomeResponse:
        doc = self._json(
            peer, "GET", self._attempt_path(namespace, step, attempt) + "/outcome", attempts=1
        )
        return OutcomeResponse.model_validate(doc)

    # -- replication ------------------------------------------------------------------------
    def pull(self, peer: str, namespace: str, step: int, origin: str, nbytes: int) -> StepInfo:
        """Ask ``peer`` to copy ``namespace/step`` from ``origin`` (this daemon) and commit it;
        returns the replica as the peer committed it. The peer answers once it has fetched and
        verified every byte, so the wait is bounded by the step's size (at 20 MB/s) on top of the
        usual timeout."""
        url = f"/v1/peer/namespaces/{namespace}/steps/{step}/pull"
        doc = self._json(
            peer,
            "POST",
            url,
            attempts=1,
            timeout_s=self.timeout_s + nbytes / 20e6,
            json=PeerPullRequest(origin=origin).model_dump(mode="json"),
        )
        return StepInfo.model_validate(doc)


def _file_url(namespace: str, step: int, attempt: str, name: str) -> str:
    return f"/v1/peer/namespaces/{namespace}/steps/{step}/attempts/{attempt}/files/{name}"
