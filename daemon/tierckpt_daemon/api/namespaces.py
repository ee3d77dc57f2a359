"""Namespaces and committed steps: list, inspect, metadata, pins for readers (and a load's one
round trip: ``reads``), hydration, delete.

Every route is for the namespace's owner only (``authorize``; see tierckpt_daemon.tier.ownership), and
what it shows of peers and of the persistent tier is that owner's steps only."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Response
from starlette.concurrency import run_in_threadpool

from tierckpt_core.errors import NotFoundError, TierCkptError
from tierckpt_core.metadata_blob import unpack_metadata
from tierckpt_core.protocol import (
    CandidatesListing,
    CandidatesRead,
    CorruptionReport,
    HydrateRequest,
    NamespaceInfo,
    PeerSources,
    PinResponse,
    RangesRequest,
    ReadRequest,
    ReadResponse,
    ReadStamp,
    StepCandidate,
    StepInfo,
)
from tierckpt_daemon.api.deps import (
    authorize,
    get_caller,
    get_node,
    get_service,
    reader_owner,
    under_lock,
)
from tierckpt_daemon.node import Node
from tierckpt_daemon.peers.replica_wait import MAX_WAIT_S
from tierckpt_daemon.tier.corruption import check_later, corruption_reported
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService
from tierckpt_daemon.tier.tenants import Caller

router = APIRouter(prefix="/v1/namespaces", dependencies=[Depends(authorize)])
Service = Annotated[TierService, Depends(get_service)]
NodeDep = Annotated[Node, Depends(get_node)]
CallerDep = Annotated[Caller, Depends(get_caller)]
Owner = Annotated[str | None, Depends(reader_owner)]


@router.get("")
def list_namespaces(service: Service, caller: CallerDep) -> list[NamespaceInfo]:
    return service.list_namespaces(None if caller.admin else caller.identity)


@router.get("/{namespace}/steps")
def list_steps(namespace: str, service: Service, owner: Owner) -> list[StepInfo]:
    return service.list_steps(namespace, owner=owner)


@router.get("/{namespace}/latest")
def latest(namespace: str, service: Service, owner: Owner) -> StepInfo:
    return service.latest(namespace, owner=owner)


@router.get(
    "/{namespace}/candidates",
    response_model=list[StepCandidate] | CandidatesRead | CandidatesListing,
)
def candidates(
    namespace: str,
    node: NodeDep,
    owner: Owner,
    read: bool = False,
    below: Annotated[int | None, Query(ge=0)] = None,
    complete: bool = False,
    unanswered: bool = False,
) -> Any:
    """Steps "latest" may pick, newest first (every durable step of the persistent tier; with
    ``complete``, a persistent tier that does not answer fails the request rather than leaving
    its steps out: ``tierckpt ls``); with
    ``read``, for a load of "latest": of the persistent tier only its newest durable steps
    (older than ``below``), and the newest candidate's answer to an unpinned ``POST .../reads``
    where this node holds it (:class:`~tierckpt_core.protocol.CandidatesRead`); with
    ``unanswered``, also the peers that did not answer
    (:class:`~tierckpt_core.protocol.CandidatesListing`)."""
    if not read:
        silent: list[str] = []
        try:
            found = node.restorer.candidates(
                namespace, owner=owner, complete=complete, silent=silent
            )
        except NotFoundError:
            if not (unanswered and silent):
                raise
            found = []  # none that answered holds one: said with the peers that did not
        if unanswered:
            return CandidatesListing(candidates=found, unanswered=silent)
        return found
    return candidates_read(node, namespace, owner, below)


def candidates_read(
    node: Node, namespace: str, owner: str | None, below: int | None = None
) -> Response:
    """The answer to ``GET .../candidates?read=true`` (blocking: peers and the persistent tier
    are asked; served by :mod:`tierckpt_daemon.api.fast_reads` in the thread pool). The newest
    candidate's read only for a load's first ask (no ``below``): asked with ``below`` (a fallback
    past a skipped step, whether a step exists) it is seldom the step loaded next."""
    found, next_below = node.restorer.newest_candidates(namespace, owner=owner, below=below)
    read = _newest_read(node.service, namespace, found, owner) if below is None else None
    answer = CandidatesRead(candidates=found, read=read, next_below=next_below)
    return Response(answer.model_dump_json(), media_type="application/json")


def _newest_read(
    service: TierService, namespace: str, found: list[StepCandidate], owner: str | None
) -> ReadResponse | None:
    """The answer to an unpinned read of the newest candidate, if this node's memory holds it and
    keeps its metadata (a step spanning nodes keeps it on a few of them); else None."""
    if not found or not found[0].in_memory:
        return None
    with service.lock:  # the version, the stamp and the records of one state of the step
        try:
            answer, _ = _open_read(service, namespace, found[0].step, owner, False, None)
        except TierCkptError:  # it left memory since the candidates were listed: the load asks
            return None
    return answer if answer.metadata is not None else None


@router.post("/{namespace}/steps/{step}/hydrate")
def hydrate(
    namespace: str, step: int, node: NodeDep, owner: Owner, req: HydrateRequest | None = None
) -> StepInfo:
    files = req.files if req is not None else None
    return node.restorer.hydrate(namespace, step, files, owner=owner)


@router.get("/{namespace}/steps/{step}/peer-sources")
def peer_sources(namespace: str, step: int, node: NodeDep, owner: Owner) -> PeerSources:
    """A step in no memory of this node, as its peers hold it: for a restore straight from them
    into the reader's tensors (connections handed over on the handoff socket)."""
    manifest, copies = node.spanning.sources(namespace, step, owner=owner)
    return PeerSources(
        manifest=manifest,
        holders={p: sorted(c.held) if c.held is not None else None for p, c in copies.items()},
        attempts={p: c.attempt for p, c in copies.items()},
        handoff=node.handoff is not None,
    )


@router.post("/{namespace}/steps/{step}/persist")
def persist(namespace: str, step: int, node: NodeDep, owner: Owner) -> StepInfo:
    _learn_durable(node, namespace, step, owner)
    return node.service.persist_now(namespace, step, owner=owner)


def _learn_durable(node: Node, namespace: str, step: int, owner: str | None) -> None:
    """A participant's share of a step spanning nodes, uploaded: whether the decider has made
    the step durable since (tier/share_durable.py). Asked where a caller waits for it."""
    if node.persister is not None:
        node.persister.learn_durable(namespace, step, owner)


@router.post("/{namespace}/steps/{step}/corruption", status_code=204)
def report_corruption(
    namespace: str,
    step: int,
    req: CorruptionReport,
    service: Service,
    owner: Owner,
) -> Response:
    """A reader found part of the step corrupt (its own load fell back, or failed): counted in
    ``tierckpt_verification_failures_total{tier}`` and logged, for the alerts and the operator;
    a file of this node's memory is checked again on a thread of its own (``check_later``)."""
    corruption_reported(service.metrics, namespace, step, req)
    if req.tier == "memory" and req.file is not None:
        check_later(service, namespace, step, req.file, owner)
    return Response(status_code=204)


@router.post("/{namespace}/steps/{step}/replicated")
def wait_replicated(
    namespace: str,
    step: int,
    node: NodeDep,
    owner: Owner,
    timeout_s: Annotated[float, Query(gt=0, le=MAX_WAIT_S)] = 300.0,
) -> StepInfo:
    """Answers once every share of the committed step has its replicas on peers (a save made
    with ``wait="replicated"``); 409 when one cannot, or not within ``timeout_s``."""
    return node.wait_replicated(namespace, step, timeout_s, owner=owner)


@router.get("/{namespace}/steps/{step}")
def get_step(namespace: str, step: int, node: NodeDep, owner: Owner) -> StepInfo:
    _learn_durable(node, namespace, step, owner)
    return node.service.get_step(namespace, step, owner=owner)


@router.get("/{namespace}/steps/{step}/metadata")
def get_metadata(namespace: str, step: int, node: NodeDep, owner: Owner) -> dict[str, Any]:
    """The step's DCP metadata in its JSON form (docs/format.md), for inspection: loads take it
    as committed (opaque, compressed) with ``POST .../reads``."""
    return unpack_metadata(
        node.restorer.metadata(namespace, step, owner=owner), where=f"{namespace}/step {step}"
    )


@router.delete("/{namespace}/steps/{step}", status_code=204)
def delete_step(namespace: str, step: int, service: Service, owner: Owner) -> Response:
    service.delete_step(namespace, step, owner=owner)
    return Response(status_code=204)


@router.post("/{namespace}/steps/{step}/pins")
def pin(namespace: str, step: int, service: Service, owner: Owner) -> PinResponse:
    return service.pin(namespace, step, owner=owner)


@router.post("/{namespace}/steps/{step}/reads", response_model=ReadResponse)
async def open_read(
    namespace: str,
    step: int,
    service: Service,
    node: NodeDep,
    owner: Owner,
    req: ReadRequest | None = None,
) -> Response:
    """A load's one round trip per phase: the step's version, pinned (as ``pins``) when asked,
    and its metadata and file records unless the reader holds those of this very commit already
    (``known``). Served by :mod:`tierckpt_daemon.api.fast_reads` before the framework's routing
    (this route documents it, and answers what that path leaves to the framework)."""
    return await read_response(service, node, namespace, step, owner, req or ReadRequest())


async def read_response(
    service: TierService,
    node: Node,
    namespace: str,
    step: int,
    owner: str | None,
    req: ReadRequest,
) -> Response:
    """The answer to ``POST .../reads``. On the trainer's path twice per load, so it runs on the
    event loop (no thread-pool hops) while the service's lock is free; fetching the metadata
    (from another node, for a step spanning nodes) goes to the thread pool."""
    answer, info = await under_lock(
        service, _open_read, service, namespace, step, owner, req.pin, req.known
    )
    if req.known != answer.version and answer.metadata is None:
        with _unpinned_on_error(service, namespace, step, answer):
            # A step spanning nodes keeps its metadata on a few of them: the restorer fetches it
            # from one (checked against its digest) where this node keeps only the digest.
            answer.metadata = await run_in_threadpool(
                node.restorer.metadata, namespace, step, owner=owner
            )
        answer.files = info.files
    # Encoded once by the model itself (the framework would validate the answer against its
    # model again first: the file records' block checksums are most of a first load's answer).
    return Response(answer.model_dump_json(), media_type="application/json")


def _open_read(
    service: TierService,
    namespace: str,
    step: int,
    owner: str | None,
    pin: bool,
    known: str | None,
) -> tuple[ReadResponse, StepInfo]:
    """The answer, with the step's metadata and records where the reader does not hold this
    version and this node keeps the metadata (its commit record here, read under the lock with
    the version: no thread-pool hop on a first load's path); else the route fetches them."""
    if pin:
        pinned = service.pin(namespace, step, owner=owner)
        info = pinned.step
        answer = ReadResponse(
            version=_version(info),
            pin_id=pinned.pin_id,
            paths=pinned.paths,
            expires_in_s=pinned.expires_in_s,
        )
    else:
        info = service.get_step(namespace, step, owner=owner)
        answer = ReadResponse(version=_version(info))
    with _unpinned_on_error(service, namespace, step, answer):
        answer.stamp = _stamp(service.record(namespace, step, owner=owner))
        if known != answer.version:
            manifest = service.manifest(namespace, step, owner=owner)
            if not manifest.metadata_elsewhere:
                answer.metadata, answer.files = manifest.metadata, info.files
    return answer, info


@contextlib.contextmanager
def _unpinned_on_error(
    service: TierService, namespace: str, step: int, answer: ReadResponse
) -> Iterator[None]:
    """Release the pin ``answer`` holds (if any) when the block fails, then let the error go on:
    an answer that is never sent must not hold the step in memory."""
    try:
        yield
    except BaseException:
        if answer.pin_id is not None:
            service.unpin(namespace, step, answer.pin_id)
        raise


def _stamp(rec: StepRecord) -> ReadStamp | None:
    """The step's commit record as it is now, under the service's lock, like the version: every
    change of a committed record is written to it (renamed into place: a new inode), and it is
    removed when the step leaves the tables. A reader that finds the same file there next time
    holds this version without asking (``DaemonClient.open_read``); it still pins through the
    daemon and takes the file records it verifies against from the pin's answer, so a stamp that
    lies (the directory is writable by the node's trainers) costs a reader a re-plan, never an
    unverified or a stale byte."""
    path = rec.manifest_path()
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return ReadStamp(path=str(path), ino=st.st_ino, ctime_ns=st.st_ctime_ns, size=st.st_size)


def _version(info: StepInfo) -> str:
    """What a reader keys its copy of a step's metadata and file records by: the commit's time and
    every file's checksum and block checksums (a step saved again, its files replaced, or a record
    that gained the block checksums of a file fetched from another node is another version)."""
    h = hashlib.sha256(repr(info.committed_at).encode())
    for f in info.files:
        blocks = len(f.blocks) if f.blocks else 0
        h.update(f"\0{f.name}\0{f.checksum}\0{f.length}\0{f.block_size}\0{blocks}".encode())
    return h.hexdigest()[:32]


@router.delete("/{namespace}/steps/{step}/pins/{pin_id}", status_code=204)
def unpin(namespace: str, step: int, pin_id: str, service: Service) -> Response:
    # In the thread pool: the last pin of a retired step gives its files back (renames,
    # unlinks), which must not hold up the event loop.
    service.unpin(namespace, step, pin_id)
    return Response(status_code=204)


@router.post("/{namespace}/steps/{step}/files/{name}/ranges", response_class=Response)
def read_ranges(
    namespace: str, step: int, name: str, req: RangesRequest, node: NodeDep, owner: Owner
) -> Response:
    """Parts of a file that another node holds (a step spanning nodes), verified, concatenated."""
    data = node.spanning.read_ranges(namespace, step, name, list(req.ranges), owner=owner)
    return Response(data, media_type="application/octet-stream")
