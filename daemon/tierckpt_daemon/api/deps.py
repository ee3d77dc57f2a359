"""Request-scoped access to the daemon's parts and the caller (FastAPI dependencies).

All are ``async``: FastAPI runs a plain ``def`` dependency in its thread pool, and each such hop
costs a request two thread wake-ups (~0.1-1 ms on a busy node, on every call of a trainer's save
and load: issue 24). The two that read the namespace's owner take the service's lock, so they
run on the event loop only when that lock is free, and in the thread pool otherwise: the event
loop never waits for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from tierckpt_daemon.node import Node
from tierckpt_daemon.tier.service import TierService
from tierckpt_daemon.tier.tenants import Caller, request_caller

T = TypeVar("T")


def _node(request: Request) -> Node:
    node: Node = request.app.state.node
    return node


async def get_node(request: Request) -> Node:
    return _node(request)


async def get_service(request: Request) -> TierService:
    return _node(request).service


async def get_caller(request: Request) -> Caller:
    return request_caller(request)


async def under_lock(service: TierService, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn`` (quick, and taking the service's reentrant lock) on the event loop if the lock is
    free now, else in the thread pool."""
    with service.lock_if_free() as free:
        if free:
            return fn(*args, **kw)
    return await run_in_threadpool(fn, *args, **kw)


async def authorize(request: Request) -> None:
    """A route on ``/v1/namespaces/{namespace}``: refuse a caller whose uid does not own the
    namespace on this node (:mod:`tierckpt_daemon.tier.ownership`)."""
    namespace = request.path_params.get("namespace")
    caller = request_caller(request)
    if namespace is not None:
        service = _node(request).service
        await under_lock(service, service.authorize, namespace, caller.identity, admin=caller.admin)


async def reader_owner(request: Request) -> str | None:
    """Whose steps a read by the caller may see, here and on peers (None: anyone's)."""
    caller = request_caller(request)
    namespace = request.path_params["namespace"]
    service = _node(request).service
    return await under_lock(
        service, service.acting_owner, namespace, caller.identity, admin=caller.admin
    )
