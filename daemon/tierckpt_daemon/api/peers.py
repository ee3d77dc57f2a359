"""Daemon-to-daemon routes (``/v1/peer/...``): served on the TCP port only, to callers that present
the shared token (``Authorization: Bearer <TIERCKPT_PEER_TOKEN>``).

Reads (a peer restoring a step, or pulling a replica): list steps, one step's manifest, stream one
file, whole or one range of it (``Range: bytes=first-last``, the one route for peers' byte
ranges). Replication: ``pull`` asks this daemon to copy one of the caller's steps (it then uses the
reads above on the caller). Commits across nodes: ``prepare``, ``commit`` (the decision),
``abort`` and ``outcome`` of one save attempt.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request, Response
from starlette.concurrency import run_in_threadpool

from tierckpt_core.errors import ForbiddenError, ProtocolError
from tierckpt_core.manifest import StepManifest
from tierckpt_core.protocol import (
    DecideRequest,
    NodeStep,
    OutcomeResponse,
    PeerPullRequest,
    PeerStep,
    PrepareRequest,
    PrepareResponse,
    StepInfo,
    validate_file_name,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon.api.peer_gate import check_peer_token
from tierckpt_daemon.peers import cluster
from tierckpt_daemon.peers.commit import GlobalCommitter
from tierckpt_daemon.peers.server import PeerServer
from tierckpt_daemon.peers.zerocopy import FileResponse, parse_range


async def require_peer_token(request: Request) -> None:
    # Checked before the body is read by api/peer_gate.PeerGate; again here, so that the routes
    # stay closed whatever serves them.
    check_peer_token(request.app.state.settings.peer_secret, request.headers.get("authorization"))


def get_peer_server(request: Request) -> PeerServer:
    store: PeerServer = request.app.state.peer_server
    return store


router = APIRouter(prefix="/v1/peer", dependencies=[Depends(require_peer_token)])
Store = Annotated[PeerServer, Depends(get_peer_server)]


@router.get("/inventory")
def inventory(request: Request, namespace: str | None = None) -> list[NodeStep]:
    """Every committed step this daemon holds in memory, for ``tierckpt ls --cluster``."""
    return cluster.inventory(request.app.state.node.service, namespace)


@router.get("/namespaces/{namespace}/steps")
def list_steps(namespace: str, store: Store) -> list[PeerStep]:
    return store.list_steps(namespace)


@router.get("/namespaces/{namespace}/steps/{step}")
def manifest(namespace: str, step: int, store: Store, metadata: bool = True) -> StepManifest:
    return store.manifest(namespace, step, metadata=metadata)


@router.get(
    "/namespaces/{namespace}/steps/{step}/attempts/{attempt}/files/{name}",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}},
        206: {
            "description": "The bytes of the one range asked for (`Range: bytes=first-last`)",
            "content": {"application/octet-stream": {}},
        },
    },
)
def get_file(
    namespace: str,
    step: int,
    attempt: str,
    name: str,
    store: Store,
    range_: Annotated[str | None, Header(alias="range")] = None,
) -> Response:
    """One file of a committed step; with ``Range: bytes=first-last``, just those bytes (206), so
    that a peer can fetch a large file in several streams at once."""
    f = store.open_file(namespace, step, attempt, name)
    try:
        span = parse_range(range_, f.length)
    except ValueError as e:
        f.close()
        raise ProtocolError(f"{namespace}/step {step}/{name}: {e}") from None
    # By sendfile on a plain connection, else streamed (see tierckpt_daemon.peers.zerocopy).
    if span is None:
        return FileResponse(f.fd, f.length, f.close)
    return FileResponse(f.fd, span[1], f.close, offset=span[0], total=f.length)


@router.post("/namespaces/{namespace}/steps/{step}/pull")
def pull(namespace: str, step: int, req: PeerPullRequest, request: Request) -> StepInfo:
    """Replicate the caller's committed step here: fetch it from ``req.origin``, verify, commit.
    Answers when the replica is committed (blocking work: FastAPI runs this in a thread)."""
    validate_namespace(namespace)
    validate_step(step)
    replicator = request.app.state.node.replicator
    if replicator is None:
        raise ForbiddenError("replication is off on this daemon (no TIERCKPT_PEERS)")
    info: StepInfo = replicator.pull_from(req.origin, namespace, step)
    return info


# -- commits across nodes (see tierckpt_daemon.peers.commit) -------------------------------
async def get_committer(request: Request) -> GlobalCommitter:  # (no hop: an attribute)
    committer: GlobalCommitter | None = request.app.state.node.committer
    if committer is None:
        raise ForbiddenError("commits across nodes are off on this daemon (no TIERCKPT_PEERS)")
    return committer


Committer = Annotated[GlobalCommitter, Depends(get_committer)]
_ATTEMPT = "/namespaces/{namespace}/steps/{step}/attempts/{attempt}"


# The two steps of a commit across nodes: async routes that run their work in the thread pool
# once (a sync route with a response model hops there twice: its answer is validated there too).
@router.post(_ATTEMPT + "/prepare")
async def prepare(
    namespace: str, step: int, attempt: str, req: PrepareRequest, committer: Committer
) -> PrepareResponse:
    _check(namespace, step, attempt)
    return await run_in_threadpool(committer.prepare, namespace, step, attempt, req)


@router.post(_ATTEMPT + "/commit")
async def decide(
    namespace: str, step: int, attempt: str, req: DecideRequest, committer: Committer
) -> StepInfo:
    _check(namespace, step, attempt)
    m = req.manifest
    if (m.namespace, m.step, m.attempt) != (namespace, step, attempt):
        raise ProtocolError(f"the decision is for {m.namespace}/step {m.step} attempt {m.attempt}")
    return await run_in_threadpool(_decide, committer, req)


def _decide(committer: GlobalCommitter, req: DecideRequest) -> StepInfo:
    info = committer.decide(req).info()
    committer.relay(req)
    # The decider does not need this node's block checksums back: slim records.
    return info.model_copy(update={"files": [f.slimmed() for f in info.files]})


@router.post(_ATTEMPT + "/abort")
def abort(namespace: str, step: int, attempt: str, committer: Committer) -> OutcomeResponse:
    _check(namespace, step, attempt)
    committer.abort(namespace, step, attempt)
    return committer.outcome(namespace, step, attempt)


@router.get(_ATTEMPT + "/outcome")
def outcome(namespace: str, step: int, attempt: str, committer: Committer) -> OutcomeResponse:
    _check(namespace, step, attempt)
    return committer.outcome(namespace, step, attempt)


def _check(namespace: str, step: int, attempt: str) -> None:
    validate_namespace(namespace)
    validate_step(step)
    validate_file_name(attempt)
