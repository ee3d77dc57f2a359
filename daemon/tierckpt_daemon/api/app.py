"""Application factory: routers, error mapping, the local-only guard and the sweeper task."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tierckpt_core.errors import ForbiddenError, NotFoundError, ProtocolError, TierCkptError
from tierckpt_core.protocol import API_VERSION, ErrorBody
from tierckpt_daemon import __version__
from tierckpt_daemon.api.cluster import router as cluster_router
from tierckpt_daemon.api.errors import error_response, invalid_request
from tierckpt_daemon.api.fast_reads import FastReads
from tierckpt_daemon.api.health import router as health_router
from tierckpt_daemon.api.namespaces import router as namespaces_router
from tierckpt_daemon.api.peer_gate import PEER_PREFIX, PeerGate
from tierckpt_daemon.api.peers import router as peers_router
from tierckpt_daemon.api.writes import router as writes_router
from tierckpt_daemon.config import DaemonSettings
from tierckpt_daemon.node import Node
from tierckpt_daemon.peers.server import PeerServer

logger = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 10.0

# Routes that the TCP port serves to anyone (probes, docs). The peer routes are served on the TCP
# port only, behind the peer token (checked before a body is read: api/peer_gate.py). Everything
# else is for local clients on the Unix socket.
PUBLIC_PATHS = frozenset(
    {"/healthz", "/readyz", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect"}
)

# Every route can answer an error, always as ErrorBody (a stable ``code`` and a ``detail``): the
# document says so, so that a client generated from it (or a fuzzer) expects what it gets; 422
# included, which FastAPI would otherwise document as its own validation-error shape.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {
        "model": ErrorBody,
        "description": "The request cannot be served: bad input (400, 422), no token (401), the "
        "wrong port (403), nothing there (404), a conflicting state (409), a body over the "
        "limit (413).",
    },
    "5XX": {
        "model": ErrorBody,
        "description": "The daemon or a tier behind it cannot serve it now: a peer or the "
        "persistent tier unavailable (502), not ready (503), over the memory budget (507).",
    },
}


class LocalOnlyGuard:
    """Reject local routes that arrive over TCP, and peer routes that arrive on the Unix socket:
    on the Unix socket uvicorn's ``server`` is ``(path, None)``, on TCP ``(host, port)``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        over_tcp = server is not None and server[1] is not None
        if scope["type"] == "http":
            path: str = scope["path"]
            peer_route = path.startswith(PEER_PREFIX)
            err: ForbiddenError | None = None
            if over_tcp and not peer_route and path not in PUBLIC_PATHS:
                err = ForbiddenError(
                    f"{path} is only served on the daemon's Unix socket, not over TCP"
                )
            elif peer_route and not over_tcp:
                err = ForbiddenError(
                    f"{path} is a peer route, served on the daemon's TCP port only"
                )
            if err is not None:
                # Unread, and the connection closed: a body that follows is not read either.
                response = JSONResponse(
                    {"code": err.code, "detail": str(err)},
                    status_code=403,
                    headers={"Connection": "close"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(node: Node, settings: DaemonSettings) -> FastAPI:
    service = node.service

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_sweeper(node))
        node.start()
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # SIGTERM: the workers stop, queued uploads get the grace period (node.close).
            await asyncio.to_thread(node.close)

    app = FastAPI(
        title="tierckpt daemon",
        version=__version__,
        description=f"Node-local tiered checkpoint store, API {API_VERSION}.",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
    )
    app.state.node = node
    app.state.settings = settings
    app.state.peer_server = PeerServer(service)

    @app.exception_handler(TierCkptError)
    async def _tierckpt_error(request: Request, exc: TierCkptError) -> JSONResponse:
        return error_response(request.method, request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid_request(request.url.path, exc.errors())

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # The framework's own answers (no such route, method not allowed, a body it cannot
        # parse) in the daemon's error shape, with a code clients know.
        code = (
            NotFoundError.code
            if exc.status_code == 404
            else ProtocolError.code
            if 400 <= exc.status_code < 500
            else TierCkptError.code
        )
        detail = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            {"code": code, "detail": detail}, status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug: still an answer in the documented shape (uvicorn logs the traceback).
        return JSONResponse(
            {
                "code": TierCkptError.code,
                "detail": f"{request.method} {request.url.path}: internal error "
                f"({type(exc).__name__}); the daemon's log has the details",
            },
            status_code=500,
        )

    app.include_router(health_router)
    app.include_router(namespaces_router)
    app.include_router(writes_router)
    app.include_router(peers_router)
    app.include_router(cluster_router)
    # The last added runs first: the wrong port is refused, then a peer route's token checked and
    # every body capped, all before a body is read; then a load's reads, past the routing.
    app.add_middleware(FastReads, node=node)
    app.add_middleware(
        PeerGate,
        secret=settings.peer_secret,
        max_record_bytes=settings.peer_max_record_bytes,
        max_body_bytes=settings.peer_max_body_bytes,
    )
    app.add_middleware(LocalOnlyGuard)
    return app


async def _sweeper(node: Node) -> None:
    """Expire leases, pins and stalled saves every SWEEP_INTERVAL_S. It never ends on an error:
    an OSError is logged, anything else (a bug) is also counted as a background failure
    (``tierckpt_background_thread_failures_total{thread="sweeper"}``, its alert, and the
    status's failed threads): a sweep that keeps failing lets the tier fill with expired
    leases, and a task that died of it would be seen by no one."""
    markers: asyncio.Future[None] | None = None
    while True:
        await asyncio.sleep(SWEEP_INTERVAL_S)
        # Participants of steps spanning nodes read markers beside the sweep, not in it: with
        # the tier hung those reads wait for its timeouts, and expiry must go on meanwhile.
        if node.persister is not None and (markers is None or markers.done()):
            markers = asyncio.ensure_future(asyncio.to_thread(node.persister.watch_markers))
        try:
            await asyncio.to_thread(node.service.sweep)
        except OSError:
            logger.exception("housekeeping sweep failed; retrying in %.0fs", SWEEP_INTERVAL_S)
        except Exception as e:
            logger.exception(
                "housekeeping sweep failed (a bug: leases, pins and stalled saves may not "
                "expire); retrying in %.0fs",
                SWEEP_INTERVAL_S,
            )
            node.failures.record("sweeper", e, died=False)
