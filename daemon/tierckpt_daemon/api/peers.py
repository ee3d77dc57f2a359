"""Daemon-to-daemon routes (``/v1/peer/...``): served on the TCP port only, to callers that present
the shared token (``Authorization: Bearer <TIERCKPT_PEER_TOKEN>``).

Reads (a peer restoring a step): list steps, one step's manifest, stream one file. Writes (a peer
pushing a replica): stream each file into a pending replica, then commit it with every checksum.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from tierckpt_client.errors import (
    ForbiddenError,
    IntegrityError,
    ProtocolError,
    UnauthorizedError,
)
from tierckpt_client.protocol import (
    MAX_FILE_BYTES,
    MAX_RANK,
    PEER_CHECKSUM_HEADER,
    PeerCommitRequest,
    PeerFileReceipt,
    PeerManifest,
    PeerStep,
    StepInfo,
    validate_file_name,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon.peer_store import PeerStore, ReceivedFile

WRITE_CHUNK = 4 << 20  # bytes gathered on the event loop before a thread writes them


async def require_peer_token(request: Request) -> None:
    secret = request.app.state.settings.peer_secret
    if secret is None:
        raise ForbiddenError(
            "replication is off on this daemon (no TIERCKPT_PEERS / TIERCKPT_PEER_TOKEN), so it "
            "serves no peer routes"
        )
    header = request.headers.get("authorization")
    if not header:
        raise UnauthorizedError(
            "missing peer token: peer routes need 'Authorization: Bearer <TIERCKPT_PEER_TOKEN>'"
        )
    scheme, _, presented = header.partition(" ")
    expected = secret.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), expected):
        raise UnauthorizedError(
            "wrong peer token: the caller's TIERCKPT_PEER_TOKEN differs from this daemon's (every "
            "daemon must have the same one)"
        )


def get_peer_store(request: Request) -> PeerStore:
    store: PeerStore = request.app.state.peer_store
    return store


router = APIRouter(prefix="/v1/peer", dependencies=[Depends(require_peer_token)])
Store = Annotated[PeerStore, Depends(get_peer_store)]


@router.get("/namespaces/{namespace}/steps")
def list_steps(namespace: str, store: Store) -> list[PeerStep]:
    return store.list_steps(namespace)


@router.get("/namespaces/{namespace}/steps/{step}")
def manifest(namespace: str, step: int, store: Store) -> PeerManifest:
    return store.manifest(namespace, step)


@router.get(
    "/namespaces/{namespace}/steps/{step}/attempts/{attempt}/files/{name}",
    response_class=StreamingResponse,
)
def get_file(namespace: str, step: int, attempt: str, name: str, store: Store) -> StreamingResponse:
    length, body = store.open_file(namespace, step, attempt, name)
    # A sync iterator: Starlette reads it in a worker thread, off the event loop.
    return StreamingResponse(
        body, media_type="application/octet-stream", headers={"Content-Length": str(length)}
    )


@router.put("/namespaces/{namespace}/steps/{step}/attempts/{attempt}/files/{name}")
async def put_file(
    namespace: str,
    step: int,
    attempt: str,
    name: str,
    request: Request,
    store: Store,
    rank: Annotated[int, Query(ge=0, lt=MAX_RANK)],
    length: Annotated[int, Query(ge=0, le=MAX_FILE_BYTES)],
) -> PeerFileReceipt:
    validate_namespace(namespace)
    validate_step(step)
    validate_file_name(attempt)
    validate_file_name(name)
    expected = request.headers.get(PEER_CHECKSUM_HEADER)
    rf: ReceivedFile = await asyncio.to_thread(store.begin_file, namespace, rank, length)
    try:
        buf = bytearray()
        async for chunk in request.stream():
            if rf.received + len(buf) + len(chunk) > length:
                raise ProtocolError(
                    f"{namespace}/step {step}: file {name} is longer than the {length} bytes "
                    "announced"
                )
            buf += chunk
            if len(buf) >= WRITE_CHUNK:
                data, buf = buf, bytearray()
                await asyncio.to_thread(rf.write, data)
        if buf:
            await asyncio.to_thread(rf.write, buf)
        if rf.received != length:
            raise ProtocolError(
                f"{namespace}/step {step}: file {name} ended after {rf.received} of {length} bytes"
            )
        if expected is not None and rf.hexdigest() != expected:
            raise IntegrityError(
                f"{namespace}/step {step}: file {name} arrived with checksum {rf.hexdigest()}, "
                f"the sender says {expected}"
            )
        digest = await asyncio.to_thread(
            store.finish_file, namespace, step, attempt, rank, name, rf
        )
    except BaseException:
        await asyncio.to_thread(store.abort_file, namespace, rf)
        raise
    return PeerFileReceipt(name=name, length=length, checksum=digest)


@router.post("/namespaces/{namespace}/steps/{step}/attempts/{attempt}/commit")
def commit(
    namespace: str, step: int, attempt: str, req: PeerCommitRequest, store: Store
) -> StepInfo:
    return store.commit(namespace, step, attempt, req)
