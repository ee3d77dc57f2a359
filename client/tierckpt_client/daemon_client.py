"""HTTP client for the node-local daemon over its Unix socket.

Torch-free. Every call has a timeout; transport failures become :class:`DaemonUnavailableError` and
daemon errors are mapped back to their exception classes by ``code``. The underlying connection is
created lazily and dropped on pickling, so objects holding a :class:`DaemonClient` can travel into
DCP's async checkpoint process.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from tierckpt_client import _reads
from tierckpt_client._uds_http import Answer, ConnectFailed, Done, UnixHTTP
from tierckpt_client.config import ClientConfig
from tierckpt_core.errors import DaemonUnavailableError, ProtocolError, TierCkptError
from tierckpt_core.http import decode_body
from tierckpt_core.protocol import (
    AttemptInfo,
    CandidatesListing,
    CandidatesRead,
    ClusterListing,
    CommitRequest,
    CorruptionReport,
    HydrateRequest,
    LeaseAfter,
    LeaseRequest,
    LeaseResponse,
    NamespaceInfo,
    PeerSources,
    PinResponse,
    RangesRequest,
    ReadRequest,
    ReadResponse,
    SealFile,
    SealRequest,
    StatusResponse,
    StepCandidate,
    StepInfo,
)

logger = logging.getLogger(__name__)

# Connections shared by the writers and readers of one process (see DaemonClient.shared): a
# training loop makes a new writer per save, and a new connection costs ~2 ms of the save's stall.
_SHARED: dict[tuple[int, ClientConfig], UnixHTTP] = {}
_SHARED_LOCK = threading.Lock()
_NODES: dict[str, str | None] = {}  # socket -> the daemon's node name (see DaemonClient.node)
REPORT_TIMEOUT_S = 2.0  # the bound on telling the daemon about corruption a reader found


@atexit.register
def _close_shared() -> None:
    with _SHARED_LOCK:
        for http in _SHARED.values():
            http.close()
        _SHARED.clear()


class DaemonClient:
    def __init__(self, config: ClientConfig | None = None, *, shared: bool = False) -> None:
        self.config = config or ClientConfig.from_env()
        self._http: UnixHTTP | None = None
        self._shared = shared

    @classmethod
    def shared(cls, config: ClientConfig | None = None) -> DaemonClient:
        """A client on this process's pooled connection to the daemon at ``config.socket``.

        ``close()`` leaves the pooled connection open for the next writer or reader; it is keyed by
        process id, so a forked or spawned child opens its own.
        """
        return cls(config, shared=True)

    @classmethod
    def from_socket(cls, socket: str | os.PathLike[str], **config: Any) -> DaemonClient:
        return cls(ClientConfig.from_env(socket=socket, **config))

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "_http": None, "_shared": self._shared}

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Writers and readers are dropped by DCP without a close(); close the pooled connection
        # rather than leave it to the garbage collector's ResourceWarning.
        self.close()

    def close(self) -> None:
        if self._http is not None:
            if not self._shared:
                self._http.close()
            self._http = None

    def _client(self) -> UnixHTTP:
        if self._http is None:
            if self._shared:
                key = (os.getpid(), self.config)
                with _SHARED_LOCK:
                    http = _SHARED.get(key)
                    if http is None:
                        http = _SHARED[key] = self._new_http()
                self._http = http
            else:
                self._http = self._new_http()
        return self._http

    def _new_http(self) -> UnixHTTP:
        return UnixHTTP(self.config.socket, self.config.connect_timeout_s)

    def _unreachable(self, e: OSError) -> DaemonUnavailableError:
        return DaemonUnavailableError(
            f"cannot reach the tierckpt daemon at {self.config.socket} ({e.strerror or e}); is "
            "it running, and does TIERCKPT_SOCKET point at its socket?"
        )

    def ping(self) -> bool:
        """Whether the daemon's socket accepts a connection (microseconds; no HTTP)."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(self.config.connect_timeout_s)
            probe.connect(str(self.config.socket))
        except OSError:
            return False
        finally:
            probe.close()
        return True

    def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float | None = None,
        raw: bool = False,
        later: bool = False,
        done: Done | None = None,
    ) -> Any:
        """The daemon's answer to one request, decoded. ``later``: only send it; an error in its
        answer is logged when this process makes its next request (or exits), or the answer goes
        to ``done``."""
        limit = timeout if timeout is not None else self.config.timeout_s
        data = json.dumps(body).encode() if body is not None else None
        try:
            if later:
                what = f"{method} {path}"
                done = done or self._answered_later(what)
                self._client().send_later(method, path, data, limit, done)
                return None
            status, content = self._client().request(method, path, data, limit)
        except OSError as e:
            raise self._failed(e, f"{method} {path}", limit) from (
                None if isinstance(e, ConnectFailed) else e
            )
        return self._decoded((status, content), f"{method} {path}", raw=raw)

    def _failed(self, e: OSError, what: str, limit: float) -> DaemonUnavailableError:
        if isinstance(e, ConnectFailed):
            return self._unreachable(e)
        if isinstance(e, TimeoutError):
            return DaemonUnavailableError(
                f"the tierckpt daemon at {self.config.socket} did not answer {what} within "
                f"{limit:.0f}s ({type(e).__name__})"
            )
        return DaemonUnavailableError(
            f"lost the connection to the tierckpt daemon at {self.config.socket} during {what} "
            f"({type(e).__name__}: {e}); is it running?"
        )

    @staticmethod
    def _decoded(answer: Answer, what: str, *, raw: bool = False) -> Any:
        status, content = answer
        if status == 204:
            return None
        if raw and status == 200:
            return content
        return decode_body(status, content, f"daemon answered {what}")

    def _answered_later(
        self, what: str
    ) -> Callable[[tuple[int, bytes] | None, BaseException | None], None]:
        def done(answer: tuple[int, bytes] | None, error: BaseException | None) -> None:
            try:
                if error is not None:
                    raise DaemonUnavailableError(
                        f"lost the connection to the tierckpt daemon at {self.config.socket} "
                        f"before it answered {what} ({type(error).__name__}: {error})"
                    )
                assert answer is not None
                if answer[0] != 204:
                    decode_body(*answer, f"daemon answered {what}")
            except TierCkptError as e:
                logger.warning("%s failed: %s", what, e)

        return done

    # -- API --------------------------------------------------------------------------------
    def status(self) -> StatusResponse:
        return StatusResponse.model_validate(self._request("GET", "/v1/status"))

    def namespaces(self) -> list[NamespaceInfo]:
        return [NamespaceInfo.model_validate(x) for x in self._request("GET", "/v1/namespaces")]

    def steps(self, namespace: str) -> list[StepInfo]:
        doc = self._request("GET", f"/v1/namespaces/{namespace}/steps")
        return [StepInfo.model_validate(x) for x in doc]

    def step(self, namespace: str, step: int) -> StepInfo:
        return StepInfo.model_validate(
            self._request("GET", f"/v1/namespaces/{namespace}/steps/{step}")
        )

    def latest(self, namespace: str) -> StepInfo:
        return StepInfo.model_validate(self._request("GET", f"/v1/namespaces/{namespace}/latest"))

    def metadata(self, namespace: str, step: int) -> dict[str, Any]:
        doc = self._request("GET", f"/v1/namespaces/{namespace}/steps/{step}/metadata")
        if not isinstance(doc, dict):
            raise ProtocolError(f"{namespace}/step {step}: metadata is not a JSON object")
        return doc

    def lease(
        self, namespace: str, rank: int, size: int, *, after: tuple[int, str] | None = None
    ) -> LeaseResponse:
        """A leased file of ``size`` bytes; with ``after=(step, attempt)`` a pre-lease, put in
        place when that save attempt commits (see ``LeaseRequest``)."""
        ahead = LeaseAfter(step=after[0], attempt=after[1]) if after is not None else None
        body = LeaseRequest(rank=rank, size=size, after=ahead).model_dump(exclude_none=True)
        return LeaseResponse.model_validate(
            self._request("POST", f"/v1/namespaces/{namespace}/leases", body)
        )

    def release(self, namespace: str, lease_id: str) -> None:
        self._request("DELETE", f"/v1/namespaces/{namespace}/leases/{lease_id}")

    def seal(
        self, namespace: str, step: int, attempt: str, rank: int, files: list[SealFile]
    ) -> StepInfo:
        body = SealRequest(rank=rank, files=files).model_dump()
        path = f"/v1/namespaces/{namespace}/steps/{step}/attempts/{attempt}/seal"
        return StepInfo.model_validate(self._request("POST", path, body))

    def commit(self, namespace: str, step: int, attempt: str, req: CommitRequest) -> StepInfo:
        path = f"/v1/namespaces/{namespace}/steps/{step}/attempts/{attempt}/commit"
        return StepInfo.model_validate(self._request("POST", path, req.model_dump()))

    def abort(self, namespace: str, step: int, attempt: str, *, abandoned: bool = False) -> None:
        """Give up an uncommitted save attempt: the daemon frees its sealed files now. With
        ``abandoned`` (an operator freeing a dead trainer's attempt), refused while one of the
        processes that wrote it still runs."""
        query = "?abandoned=true" if abandoned else ""
        path = f"/v1/namespaces/{namespace}/steps/{step}/attempts/{attempt}{query}"
        self._request("DELETE", path)

    def attempts(self, namespace: str, step: int) -> list[AttemptInfo]:
        """The step's save attempts not committed: in progress, or left by a dead trainer."""
        doc = self._request("GET", f"/v1/namespaces/{namespace}/steps/{step}/attempts")
        return [AttemptInfo.model_validate(x) for x in doc]

    def cluster(self, namespace: str | None = None, *, timeout_s: float = 5.0) -> ClusterListing:
        """Every node's committed steps: the daemon asks its peers, each within ``timeout_s``
        (one that does not answer in time is listed as unreachable)."""
        query = urlencode(
            {"timeout_s": timeout_s, **({"namespace": namespace} if namespace else {})}
        )
        doc = self._request(
            "GET", f"/v1/cluster?{query}", timeout=timeout_s + self.config.timeout_s
        )
        return ClusterListing.model_validate(doc)

    def candidates(self, namespace: str, *, complete: bool = False) -> list[StepCandidate]:
        """Steps "latest" may pick, newest first, and the tiers that hold them. A persistent
        tier that does not answer leaves its steps out, unless ``complete``: then its error is
        raised (a :class:`PersistentTierError`; a daemon older than this leaves them out)."""
        query = "?complete=true" if complete else ""
        doc = self._request("GET", f"/v1/namespaces/{namespace}/candidates{query}")
        return [StepCandidate.model_validate(x) for x in doc]

    def listing(self, namespace: str) -> CandidatesListing:
        """Every step of ``namespace`` that any tier holds (as :meth:`candidates` with
        ``complete``), and the peers that did not answer the daemon's listing (a daemon older
        than this names none)."""
        doc = self._request(
            "GET", f"/v1/namespaces/{namespace}/candidates?complete=true&unanswered=true"
        )
        if isinstance(doc, list):
            return CandidatesListing(candidates=[StepCandidate.model_validate(x) for x in doc])
        return CandidatesListing.model_validate(doc)

    def candidates_read(self, namespace: str, below: int | None = None) -> CandidatesRead:
        """The candidates of a load of "latest" (older than ``below``; of the persistent tier
        only its newest durable steps: ``next_below`` says where to ask for older ones), and the
        newest one's answer to an unpinned :meth:`open_read` where the daemon holds it (a load
        of "latest" in one round trip before DCP plans); a daemon older than this answers every
        candidate and no read."""
        query = "read=true" if below is None else f"read=true&below={below}"
        doc = self._request("GET", f"/v1/namespaces/{namespace}/candidates?{query}")
        if isinstance(doc, list):
            return CandidatesRead(candidates=[StepCandidate.model_validate(x) for x in doc])
        answer = CandidatesRead.model_validate(doc)
        if answer.read is not None and answer.candidates:
            step = answer.candidates[0].step
            _reads.remember((str(self.config.socket), namespace, step), answer.read)
        return answer

    def hydrate(self, namespace: str, step: int, files: list[str] | None = None) -> StepInfo:
        """Bring a step into this node's memory from a peer or the persistent tier (a long
        call); of a step spanning nodes, also the ``files`` that other nodes hold."""
        path = f"/v1/namespaces/{namespace}/steps/{step}/hydrate"
        body = HydrateRequest(files=files).model_dump() if files is not None else None
        return StepInfo.model_validate(
            self._request("POST", path, body, timeout=self.config.hydrate_timeout_s)
        )

    def peer_sources(self, namespace: str, step: int) -> PeerSources:
        """A step in no memory of this node as its peers hold it (manifest, which peer holds
        what), and whether the daemon hands over connections to them for a direct restore."""
        path = f"/v1/namespaces/{namespace}/steps/{step}/peer-sources"
        return PeerSources.model_validate(self._request("GET", path))

    def read_ranges(
        self, namespace: str, step: int, name: str, ranges: list[tuple[int, int]]
    ) -> bytes:
        """Parts of a file of a step spanning nodes that another node holds, concatenated: the
        daemon fetches whole blocks from a peer and verifies each before it answers."""
        path = f"/v1/namespaces/{namespace}/steps/{step}/files/{name}/ranges"
        body = RangesRequest(ranges=ranges).model_dump(mode="json")
        data: bytes = self._request(
            "POST", path, body, timeout=self.config.hydrate_timeout_s, raw=True
        )
        return data

    def node(self) -> str | None:
        """This daemon's node name among its peers (``TIERCKPT_NODE_NAME``), None if it has no
        peers. Asked once per process and socket (a save asks it on every rank)."""
        key = str(self.config.socket)
        if key not in _NODES:
            replication = self.status().replication
            _NODES[key] = replication.node if replication is not None else None
        return _NODES[key]

    def persist(self, namespace: str, step: int) -> StepInfo:
        """Queue a committed step for upload to the persistent tier now."""
        path = f"/v1/namespaces/{namespace}/steps/{step}/persist"
        return StepInfo.model_validate(self._request("POST", path))

    def report_corruption(self, namespace: str, step: int, report: CorruptionReport) -> None:
        """Tell the daemon that a reader found part of a step corrupt, for its metrics and log.
        Best effort: never raises, waits at most ``REPORT_TIMEOUT_S`` for the answer, and says
        at DEBUG when the daemon cannot be told (the reader's own error or fallback stands)."""
        path = f"/v1/namespaces/{namespace}/steps/{step}/corruption"
        try:
            self._request("POST", path, report.model_dump(mode="json"), timeout=REPORT_TIMEOUT_S)
        except (TierCkptError, OSError) as e:
            logger.debug("could not report corruption of %s/step %d: %s", namespace, step, e)

    def wait_replicated(self, namespace: str, step: int, timeout_s: float = 300.0) -> StepInfo:
        """Wait until every share of a committed step has its replicas on peers (the daemon
        answers then); StepStateError when one cannot, or not within ``timeout_s``."""
        path = f"/v1/namespaces/{namespace}/steps/{step}/replicated?timeout_s={timeout_s:g}"
        return StepInfo.model_validate(self._request("POST", path, timeout=timeout_s + 30.0))

    def delete(self, namespace: str, step: int) -> None:
        self._request("DELETE", f"/v1/namespaces/{namespace}/steps/{step}")

    def pin(self, namespace: str, step: int) -> PinResponse:
        return PinResponse.model_validate(
            self._request("POST", f"/v1/namespaces/{namespace}/steps/{step}/pins")
        )

    def open_read(
        self, namespace: str, step: int, known: str | None = None, *, pin: bool = True
    ) -> ReadResponse:
        """A step in this node's memory for a load: its version, pinned (``pin``), with its
        metadata and file records unless the caller holds those of version ``known`` already.

        Without ``pin``, for a ``known`` version whose commit record the daemon's last answer
        named and ``lstat`` finds unchanged: answered here (version ``known``, nothing else), as
        the daemon would, and the load's pin is sent ahead, for its next ``open_read`` with
        ``pin`` to claim; else asked, and the pin sent ahead right after the answer (a first
        load of the step: its pin is served while DCP plans); see :mod:`tierckpt_client._reads`,
        also for why neither takes a byte on trust."""
        key = (str(self.config.socket), namespace, step)
        path = f"/v1/namespaces/{namespace}/steps/{step}/reads"
        if pin:
            ahead = _reads.claim(key)
            answer = _reads.claimed(self, ahead, known) if ahead is not None else None
            if answer is not None:
                return answer
        elif (
            known is not None
            and _reads.unchanged(key, known)
            and _reads.pin_ahead(self, key, known)
        ):
            return ReadResponse(version=known)
        body = ReadRequest(known=known, pin=pin).model_dump()
        answer = ReadResponse.model_validate(self._request("POST", path, body))
        _reads.remember(key, answer)
        if not pin and answer.stamp is not None:
            # A first load of this version: its pin goes now too, served while DCP plans.
            _reads.pin_ahead(self, key, answer.version)
        return answer

    def unpin(self, namespace: str, step: int, pin_id: str, *, wait: bool = True) -> None:
        """Release a pin. ``wait=False``: send the request and return (a load's last request,
        off its path); a failure is logged as a warning when this process next asks its daemon
        anything, which the daemon then answers with the pin released."""
        path = f"/v1/namespaces/{namespace}/steps/{step}/pins/{pin_id}"
        self._request("DELETE", path, later=not wait)
