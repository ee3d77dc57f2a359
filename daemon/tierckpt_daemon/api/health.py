"""Probes and daemon status."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tierckpt_core.protocol import StatusResponse
from tierckpt_daemon.api.deps import get_node, get_service
from tierckpt_daemon.node import Node
from tierckpt_daemon.tier.service import TierService

router = APIRouter()


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(service: Annotated[TierService, Depends(get_service)]) -> dict[str, str]:
    service.arena.root.stat()  # the tier directory is still there
    return {"status": "ready"}


@router.get("/metrics", response_class=Response)
def metrics(service: Annotated[TierService, Depends(get_service)]) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/status")
def status(request: Request, node: Annotated[Node, Depends(get_node)]) -> StatusResponse:
    return node.status(str(request.app.state.settings.shm_dir))
