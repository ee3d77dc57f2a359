"""Request-scoped access to the service (FastAPI dependency)."""

from __future__ import annotations

from fastapi import Request

from tierckpt_daemon.service import TierService


def get_service(request: Request) -> TierService:
    service: TierService = request.app.state.service
    return service
