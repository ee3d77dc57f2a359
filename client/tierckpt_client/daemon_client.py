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
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from tierckpt_client._uds_http import ConnectFailed, UnixHTTP
from tierckpt_client.config import ClientConfig
from tierckpt_core.errors import DaemonUnavailableError, ProtocolError, TierCkptError
from tierckpt_core.http import decode_body
from tierckpt_core.protocol import (
    ClusterListing,
    CommitRequest,
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
    ReadStamp,
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
# What the daemons answered this process's ``open_read`` of a step last, by (socket, namespace,
# step): the version, and its commit record in the tier directory as the daemon found it then.
_STAMPS: OrderedDict[tuple[str, str, int], tuple[str, ReadStamp]] = OrderedDict()
_STAMPS_MAX = 64
_STAMPS_LOCK = threading.Lock()


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
    ) -> Any:
        """The daemon's answer to one request, decoded. ``later``: only send it; an error in its
        answer is logged when this process makes its next request (or exits)."""
        limit = timeout if timeout is not None else self.config.timeout_s
        data = json.dumps(body).encode() if body is not None else None
        try:
            if later:
                what = f"{method} {path}"
                self._client().send_later(method, path, data, limit, self._answered_later(what))
                return None
            status, content = self._client().request(method, path, data, limit)
        except ConnectFailed as e:
            raise self._unreachable(e) from None
        except TimeoutError as e:
            raise DaemonUnavailableError(
                f"the tierckpt daemon at {self.config.socket} did not answer {method} {path} "
                f"within {limit:.0f}s ({type(e).__name__})"
            ) from e
        except OSError as e:
            raise DaemonUnavailableError(
                f"lost the connection to the tierckpt daemon at {self.config.socket} during "
                f"{method} {path} ({type(e).__name__}: {e}); is it running?"
            ) from e
        if status == 204:
            return None
        if raw and status == 200:
            return content
        return decode_body(status, content, f"daemon answered {method} {path}")

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

    def abort(self, namespace: str, step: int, attempt: str) -> None:
        """Give up an uncommitted save attempt: the daemon frees its sealed files now."""
        self._request("DELETE", f"/v1/namespaces/{namespace}/steps/{step}/attempts/{attempt}")

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

    def candidates(self, namespace: str) -> list[StepCandidate]:
        doc = self._request("GET", f"/v1/namespaces/{namespace}/candidates")
        return [StepCandidate.model_validate(x) for x in doc]

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

        Without ``pin``, for a ``known`` version that the daemon last answered this process, and
        whose commit record is the same file still (:class:`ReadStamp`, an ``lstat``): answered
        here without a request (version ``known``, nothing else), as the daemon would. Nothing
        is read on the strength of it: a load's pin asks the daemon, whose answer has the
        step's version then, and its file records, which the bytes are verified against, when
        they are not those of ``known``."""
        key = (str(self.config.socket), namespace, step)
        if not pin and known is not None and _unchanged(key, known):
            return ReadResponse(version=known)
        body = ReadRequest(known=known, pin=pin).model_dump()
        path = f"/v1/namespaces/{namespace}/steps/{step}/reads"
        answer = ReadResponse.model_validate(self._request("POST", path, body))
        with _STAMPS_LOCK:
            if answer.stamp is None:
                _STAMPS.pop(key, None)
            else:
                _STAMPS[key] = (answer.version, answer.stamp)
                _STAMPS.move_to_end(key)
                while len(_STAMPS) > _STAMPS_MAX:
                    _STAMPS.popitem(last=False)
        return answer

    def unpin(self, namespace: str, step: int, pin_id: str, *, wait: bool = True) -> None:
        """Release a pin. ``wait=False``: send the request and return (a load's last request,
        off its path); a failure is logged as a warning when this process next asks its daemon
        anything, which the daemon then answers with the pin released."""
        path = f"/v1/namespaces/{namespace}/steps/{step}/pins/{pin_id}"
        self._request("DELETE", path, later=not wait)


def _unchanged(key: tuple[str, str, int], version: str) -> bool:
    """Whether the daemon answered ``version`` for the step last and its commit record is the
    same file still (the daemon rewrites it, as a new file, on every change of the step, and
    removes it when the step leaves its memory)."""
    with _STAMPS_LOCK:
        seen = _STAMPS.get(key)
    if seen is None or seen[0] != version:
        return False
    stamp = seen[1]
    try:
        st = os.lstat(stamp.path)
    except OSError:
        return False
    return (st.st_ino, st.st_ctime_ns, st.st_size) == (stamp.ino, stamp.ctime_ns, stamp.size)
