"""Request-scoped access to the daemon's parts and the caller (FastAPI dependencies)."""

from __future__ import annotations

from fastapi import Request

from tierckpt_daemon.node import Node
from tierckpt_daemon.tier.service import TierService
from tierckpt_daemon.tier.tenants import Caller, request_caller


def get_node(request: Request) -> Node:
    node: Node = request.app.state.node
    return node


def get_service(request: Request) -> TierService:
    return get_node(request).service


def get_caller(request: Request) -> Caller:
    return request_caller(request)


def authorize(request: Request) -> None:
    """A route on ``/v1/namespaces/{namespace}``: refuse a caller whose uid does not own the
    namespace on this node (:mod:`tierckpt_daemon.tier.ownership`)."""
    namespace = request.path_params.get("namespace")
    caller = request_caller(request)
    if namespace is not None:
        get_service(request).authorize(namespace, caller.identity, admin=caller.admin)


def reader_owner(request: Request) -> str | None:
    """Whose steps a read by the caller may see, here and on peers (None: anyone's)."""
    caller = request_caller(request)
    namespace = request.path_params["namespace"]
    return get_service(request).acting_owner(namespace, caller.identity, admin=caller.admin)
