"""Request-scoped access to the daemon's parts (FastAPI dependencies)."""

from __future__ import annotations

from fastapi import Request

from tierckpt_daemon.node import Node
from tierckpt_daemon.service import TierService


def get_node(request: Request) -> Node:
    node: Node = request.app.state.node
    return node


def get_service(request: Request) -> TierService:
    return get_node(request).service
