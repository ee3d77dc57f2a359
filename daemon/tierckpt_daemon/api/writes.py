"""The write path: leases of shard files, sealing a rank's files into a step, committing a step
(or aborting a failed save attempt). For the namespace's owner only (see tierckpt_daemon.tier.ownership):
the first save into a namespace on a node makes the caller's uid its owner there."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from starlette.concurrency import run_in_threadpool

from tierckpt_core.protocol import (
    AttemptInfo,
    CommitRequest,
    LeaseRequest,
    LeaseResponse,
    SealRequest,
    StepInfo,
)
from tierckpt_daemon.api.deps import authorize, get_caller, get_node, get_service
from tierckpt_daemon.node import Node
from tierckpt_daemon.tier.service import TierService
from tierckpt_daemon.tier.tenants import Caller

router = APIRouter(prefix="/v1/namespaces/{namespace}", dependencies=[Depends(authorize)])
Service = Annotated[TierService, Depends(get_service)]
NodeDep = Annotated[Node, Depends(get_node)]
CallerDep = Annotated[Caller, Depends(get_caller)]


@router.post("/leases")
async def lease(
    namespace: str, req: LeaseRequest, service: Service, caller: CallerDep
) -> LeaseResponse:
    """A file to fill now, or with ``after`` a pre-lease: the rank's next file, put in place when
    that save attempt commits (``pending``; its path does not exist until then)."""
    return await run_in_threadpool(
        service.lease, namespace, req.rank, req.size, after=req.after, owner=caller.identity
    )


@router.delete("/leases/{lease_id}", status_code=204)
def release(namespace: str, lease_id: str, service: Service, caller: CallerDep) -> Response:
    service.release_lease(namespace, lease_id, caller.identity, admin=caller.admin)
    return Response(status_code=204)


@router.post("/steps/{step}/attempts/{attempt}/seal")
async def seal(
    namespace: str, step: int, attempt: str, req: SealRequest, service: Service, caller: CallerDep
) -> StepInfo:
    return await run_in_threadpool(
        service.seal,
        namespace,
        step,
        attempt,
        req,
        owner=caller.identity,
        admin=caller.admin,
        pid=caller.pid,
    )


@router.get("/steps/{step}/attempts")
def attempts(namespace: str, step: int, service: Service) -> list[AttemptInfo]:
    """The step's save attempts not committed (in progress, or left by a dead trainer)."""
    return service.attempts(namespace, step)


@router.delete("/steps/{step}/attempts/{attempt}", status_code=204)
def abort(
    namespace: str, step: int, attempt: str, service: Service, abandoned: bool = False
) -> Response:
    """A writer gives up a save attempt that failed: its sealed files are freed now. With
    ``abandoned`` (an operator's ``tierckpt rm --abandoned``): refused while a writer runs."""
    service.abort(namespace, step, attempt, abandoned=abandoned)
    return Response(status_code=204)


@router.post("/steps/{step}/attempts/{attempt}/commit")
async def commit(
    namespace: str, step: int, attempt: str, req: CommitRequest, node: NodeDep
) -> StepInfo:
    return await run_in_threadpool(node.commit, namespace, step, attempt, req)
