"""HTTP client of the daemon-to-daemon routes (``/v1/peer/...`` on a peer's TCP port).

Thread-safe (one pooled ``httpx.Client``). Every call carries the shared token, so every call goes
to a current member of the ring and nowhere else (:class:`~tierckpt_daemon.peers.membership.Members`,
checked where each URL or connection is made: NotAMemberError, nothing sent), and has a timeout:
``timeout_s`` to connect and for each read or write (a transfer that keeps moving may take longer in
total; one that stalls fails). Transport failures become :class:`PeerUnavailableError` naming the
peer; a peer's JSON errors map back to their classes by ``code``. Idempotent calls are retried a
few times with tenacity; a replication (``pull``) is retried by the replicator.

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
import ssl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
from tenacity import (
    Retrying,
    before_sleep_log,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from tierckpt_core.errors import (
    PeerUnavailableError,
    ProtocolError,
    TierCkptError,
)
from tierckpt_core.http import decode_response
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
    read_head,
    receive,
    recv_exact,
)
from tierckpt_daemon.peers.membership import Members
from tierckpt_daemon.peers.tls import PeerTLS, describe_tls_error

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
RETRIES = 3
RANGE_STREAMS = 4  # connections at once for one large file: its receive copies and checksums
# then run on several cores, not one thread
RANGE_MIN = 64 << 20  # smaller files come in one stream


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


class PeerClient:
    def __init__(
        self,
        token: str,
        *,
        members: Members,
        timeout_s: float = 10.0,
        tls: PeerTLS | None = None,
    ) -> None:
        self.members = members
        self.timeout_s = timeout_s
        self.tls = tls
        self._scheme = "https" if tls is not None else "http"
        self._ssl = tls.client_context() if tls is not None else None
        self._auth = f"Bearer {token}"
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s),
            headers={"Authorization": f"Bearer {token}"},
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            verify=self._ssl if self._ssl is not None else True,
            trust_env=False,  # peers are dialed directly, never through a proxy from the env
        )
        self._ranges = ThreadPoolExecutor(2 * RANGE_STREAMS, thread_name_prefix="tierckpt-range")

    def close(self) -> None:
        self._http.close()
        self._ranges.shutdown(wait=False, cancel_futures=True)

    # -- plumbing ---------------------------------------------------------------------------
    def _url(self, peer: str, path: str) -> str:
        self.members.require(peer, f"peer request {path}")
        return f"{self._scheme}://{peer}{path}"

    def _extensions(self) -> dict[str, Any]:
        """The name the peer's certificate is checked for, when it is not the peer's host."""
        if self.tls is not None and self.tls.server_name:
            return {"sni_hostname": self.tls.server_name}
        return {}

    def _connection(self, peer: str) -> http.client.HTTPConnection:
        self.members.require(peer, "peer request")
        if self.tls is None or self._ssl is None:
            return http.client.HTTPConnection(peer, timeout=self.timeout_s)
        return _HTTPSConnection(
            peer,
            timeout=self.timeout_s,
            context=self._ssl,
            server_name=self.tls.expected_name(peer),
        )

    def _unavailable(
        self, peer: str, method: str, path: str, e: BaseException
    ) -> PeerUnavailableError:
        tls_problem = describe_tls_error(peer, e, self.tls)
        if tls_problem is not None:
            return PeerTLSError(f"{tls_problem} ({method} {path})")
        if isinstance(e, httpx.HTTPError):
            return _unavailable(peer, method, path, e)
        what = "did not answer in time" if isinstance(e, TimeoutError) else "failed"
        return PeerUnavailableError(
            f"peer {peer}: {method} {path} {what} ({type(e).__name__}: {e or 'no detail'})"
        )

    def _retrying(self, attempts: int) -> Retrying:
        return Retrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=0.25, max=2.0),
            before_sleep=before_sleep_log(logger, logging.INFO),
            reraise=True,
        )

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
            try:
                resp = self._http.request(
                    method,
                    self._url(peer, path),
                    timeout=timeout_s or self.timeout_s,
                    extensions=self._extensions(),
                    **kwargs,
                )
            except httpx.HTTPError as e:
                raise self._unavailable(peer, method, path, e) from e
            return _decode(peer, method, path, resp)

        return self._retrying(attempts)(once)

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

    def manifest(self, peer: str, namespace: str, step: int) -> StepManifest:
        doc = self._json(peer, "GET", f"/v1/peer/namespaces/{namespace}/steps/{step}")
        return StepManifest.model_validate(doc)

    def get_file(
        self, peer: str, namespace: str, step: int, attempt: str, name: str, path: str, length: int
    ) -> str:
        """Stream one file of ``peer``'s step into the local file ``path`` (written in place, no
        second buffer); return the checksum of the bytes received. The caller verifies it."""
        url = f"/v1/peer/namespaces/{namespace}/steps/{step}/attempts/{attempt}/files/{name}"

        def once() -> str:
            # http.client rather than httpx for the bulk bytes: its readinto() fills a large
            # buffer straight from the socket, where httpx hands out 64 KiB pieces through h11
            # (about a third of the throughput here).
            conn = self._connection(peer)
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                conn.request("GET", url, headers={"Authorization": self._auth})
                resp = conn.getresponse()
                if resp.status != 200:
                    body = resp.read()
                    _decode(peer, "GET", url, httpx.Response(resp.status, content=body))
                    raise ProtocolError(f"peer {peer}: GET {url} answered HTTP {resp.status}")
                if resp.length is not None and resp.length != length:
                    raise ProtocolError(
                        f"peer {peer}: {url} is {resp.length} bytes, the manifest says {length}"
                    )
                return receive(resp, fd, length, f"peer {peer}: {url}")
            except (OSError, http.client.HTTPException) as e:
                raise self._unavailable(peer, "GET", url, e) from e
            finally:
                os.close(fd)
                conn.close()

        return self._retrying(RETRIES)(once)

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
    ) -> None:
        """Fetch one file of ``peer``'s step into the local file ``path`` in up to
        ``RANGE_STREAMS`` ranges at once (one connection each, whole blocks), checking every
        block against ``blocks`` (the writer's checksums) as it arrives, while it is in the cache.
        BlockMismatchError (an IntegrityError) names the first block that does not match. A peer
        that does not answer ranges sends the whole file in one stream, checked the same way."""
        if block_size <= 0 or len(blocks) != -(-length // block_size):
            raise ProtocolError(
                f"peer {peer}: {name} has {len(blocks)} block checksums of {block_size} bytes "
                f"for {length} bytes"
            )
        url = f"/v1/peer/namespaces/{namespace}/steps/{step}/attempts/{attempt}/files/{name}"
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
                conn = self._connection(peer)
                fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    headers = {"Authorization": self._auth}
                    if not whole:
                        headers["Range"] = f"bytes={start}-{stop - 1}"
                    conn.request("GET", url, headers=headers)
                    resp = conn.getresponse()
                    if resp.status == 200 and not whole:
                        return False
                    if resp.status not in (200, 206):
                        body = resp.read()
                        _decode(peer, "GET", url, httpx.Response(resp.status, content=body))
                        raise ProtocolError(f"peer {peer}: GET {url} answered HTTP {resp.status}")
                    if resp.status == 206 and resp.getheader("content-range") != (
                        f"bytes {start}-{stop - 1}/{length}"
                    ):
                        raise ProtocolError(
                            f"peer {peer}: {url} answered bytes "
                            f"{resp.getheader('content-range')!r} for {start}-{stop - 1}/{length}"
                        )
                    if resp.length is not None and resp.length != stop - start:
                        raise ProtocolError(
                            f"peer {peer}: {url} sent {resp.length} bytes for {start}-{stop - 1}"
                        )
                    receive_to(
                        lambda view, _at: resp.readinto(view),
                        pwriter(fd),
                        sums,
                        start,
                        stop,
                        short=PeerUnavailableError,
                    )
                    return True
                except (OSError, http.client.HTTPException) as e:
                    raise self._unavailable(peer, "GET", url, e) from e
                finally:
                    os.close(fd)
                    conn.close()

            return bool(self._retrying(RETRIES)(once))

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
        url = f"/v1/peer/namespaces/{namespace}/steps/{step}/attempts/{attempt}/files/{name}"
        if not 0 <= start < stop:
            raise ProtocolError(f"peer {peer}: {url}: empty or negative range {start}-{stop}")
        what = f"peer {peer}: {url}"

        def check(
            status: int, headers: Callable[[str], str | None], body: Callable[[], bytes]
        ) -> None:
            if status != 206:
                _decode(peer, "GET", url, httpx.Response(status, content=body()))
                raise ProtocolError(f"{what} with a range answered HTTP {status}, not 206")
            got = headers("content-range") or ""
            if not got.startswith(f"bytes {start}-{stop - 1}/") or headers("content-length") != str(
                stop - start
            ):
                raise ProtocolError(
                    f"{what} answered bytes {got!r} ({headers('content-length')} bytes) for "
                    f"{start}-{stop - 1}"
                )

        def plain() -> socket.socket:
            self.members.require(peer, f"peer request {url}")
            addr = http.client.HTTPConnection(peer)  # parses host:port as requests to peers do
            try:
                sock = socket.create_connection((addr.host, addr.port), timeout=self.timeout_s)
            except OSError as e:
                raise self._unavailable(peer, "GET", url, e) from e
            try:
                sock.sendall(
                    (
                        f"GET {url} HTTP/1.1\r\nHost: {peer}\r\nAuthorization: {self._auth}\r\n"
                        f"Range: bytes={start}-{stop - 1}\r\nConnection: close\r\n\r\n"
                    ).encode()
                )
                status, headers = read_head(sock, what)
                n = min(int(headers.get("content-length", "0") or 0), MAX_HEAD)
                check(status, headers.get, lambda: recv_exact(sock, n, what))
                return sock
            except OSError as e:
                sock.close()
                raise self._unavailable(peer, "GET", url, e) from e
            except BaseException:
                sock.close()
                raise

        def tls() -> RangeStream:
            conn = self._connection(peer)
            try:
                conn.request(
                    "GET",
                    url,
                    headers={
                        "Authorization": self._auth,
                        "Range": f"bytes={start}-{stop - 1}",
                        "Connection": "close",
                    },
                )
                resp = conn.getresponse()
                check(resp.status, resp.getheader, lambda: resp.read(MAX_HEAD))
                return RangeStream(conn, resp, stop - start, what)
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise self._unavailable(peer, "GET", url, e) from e
            except BaseException:
                conn.close()
                raise

        once: Callable[[], socket.socket | RangeStream] = plain if self.tls is None else tls
        return self._retrying(RETRIES)(once)

    def read_range(
        self, peer: str, namespace: str, step: int, name: str, offset: int, length: int
    ) -> bytes:
        """``length`` bytes at ``offset`` of a file ``peer`` holds (unverified: the caller checks
        them against the block checksums)."""
        path = f"/v1/peer/namespaces/{namespace}/steps/{step}/files/{name}/range"

        def once() -> bytes:
            try:
                resp = self._http.get(
                    self._url(peer, path),
                    params={"offset": offset, "length": length},
                    extensions=self._extensions(),
                )
            except httpx.HTTPError as e:
                raise self._unavailable(peer, "GET", path, e) from e
            if resp.status_code != 200:
                _decode(peer, "GET", path, resp)
                raise ProtocolError(f"peer {peer}: GET {path} answered HTTP {resp.status_code}")
            if len(resp.content) != length:
                raise PeerUnavailableError(
                    f"peer {peer}: {path} sent {len(resp.content)} of {length} bytes"
                )
            return resp.content

        return self._retrying(RETRIES)(once)

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

    def decide(self, peer: str, req: DecideRequest, *, timeout_s: float | None = None) -> StepInfo:
        m = req.manifest
        assert m.attempt is not None
        doc = self._json(
            peer,
            "POST",
            self._attempt_path(m.namespace, m.step, m.attempt) + "/commit",
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


def _transient(e: BaseException) -> bool:
    return isinstance(e, PeerUnavailableError) and not isinstance(e, PeerTLSError)


def _unavailable(peer: str, method: str, path: str, e: httpx.HTTPError) -> PeerUnavailableError:
    what = "did not answer in time" if isinstance(e, httpx.TimeoutException) else "failed"
    return PeerUnavailableError(
        f"peer {peer}: {method} {path} {what} ({type(e).__name__}: {e or 'no detail'})"
    )


def _decode(peer: str, method: str, path: str, resp: httpx.Response) -> Any:
    try:
        return decode_response(
            resp, f"peer {peer} answered {method} {path}", prefix=f"peer {peer}: "
        )
    except TierCkptError as e:
        if type(e) is TierCkptError:  # an unexpected failure in the peer: maybe transient
            raise PeerUnavailableError(str(e)) from None
        raise
