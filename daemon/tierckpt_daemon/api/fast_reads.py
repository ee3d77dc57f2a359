"""A load's requests, ``POST /v1/namespaces/{namespace}/steps/{step}/reads`` and ``GET
/v1/namespaces/{namespace}/candidates?read=true`` (a load of "latest"), answered before the
framework's routing and dependency solving.

Every load asks these once or twice (``read_metadata``'s metadata, or with "latest" the
candidates; ``read_data``'s pin, usually sent ahead), and a restore of a few hundred MiB is a
copy of a few milliseconds: the framework's own work per request (its middleware, the route's
match, solving its five dependencies, the body's validation) was about half of what the daemon
spent on the request, measured with py-spy on the 2-core box (docs/benchmarks.md, "A resume's
requests"). Here the same steps are done directly, with the same functions: who is calling (the
kernel's peer credentials, :func:`~tierckpt_daemon.tier.tenants.request_caller`), that the
caller may read the namespace (``TierService.authorize``) and whose steps it reads
(``acting_owner``), the body as :class:`~tierckpt_core.protocol.ReadRequest`, then the routes'
own :func:`~tierckpt_daemon.api.namespaces.read_response` and ``candidates_read`` (the latter in
the thread pool, as its route: it may ask peers and the persistent tier). Errors are answered as
every route answers them (:func:`~tierckpt_daemon.api.errors.error_response`; a body that is not
a ``ReadRequest`` is a 422 naming the field). Anything else (another path, method or query, or a
path the patterns do not take, such as a step that is not a plain number) goes on to the
framework, which answers it as before.

It runs inside :class:`~tierckpt_daemon.api.app.LocalOnlyGuard` and
:class:`~tierckpt_daemon.api.peer_gate.PeerGate`: over TCP the route is refused before it gets
here, as before.
"""

from __future__ import annotations

import re

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from tierckpt_core.errors import ProtocolError, TierCkptError
from tierckpt_core.protocol import ReadRequest
from tierckpt_daemon.api.deps import under_lock
from tierckpt_daemon.api.errors import error_response, invalid_request
from tierckpt_daemon.api.namespaces import candidates_read, read_response
from tierckpt_daemon.node import Node
from tierckpt_daemon.tier.tenants import request_caller

PATH = re.compile(r"/v1/namespaces/([^/]+)/steps/([0-9]{1,18})/reads")
CANDIDATES = re.compile(r"/v1/namespaces/([^/]+)/candidates")
BODY_MAX = 64 << 10
"""A ``ReadRequest`` is a few dozen bytes: a larger body is refused unread past this."""


class FastReads:
    """ASGI middleware: ``POST .../reads`` and ``GET .../candidates?read=true`` answered here,
    everything else passed on."""

    def __init__(self, app: ASGIApp, node: Node) -> None:
        self.app = app
        self.node = node

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response: Response | None = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope["query_string"]:
            match = PATH.fullmatch(scope["path"])
            if match is not None:
                response = await self._answer(scope, receive, match.group(1), int(match.group(2)))
        elif (
            scope["type"] == "http"
            and scope["method"] == "GET"
            and scope["query_string"] == b"read=true"
        ):
            match = CANDIDATES.fullmatch(scope["path"])
            if match is not None:
                response = await self._candidates(scope, match.group(1))
        if response is None:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)

    async def _owner(self, scope: Scope, namespace: str) -> str | None:
        """Whose steps of ``namespace`` the caller reads (refused if it may not read them)."""
        caller = request_caller(Request(scope))
        service = self.node.service
        who, admin = caller.identity, caller.admin
        await under_lock(service, service.authorize, namespace, who, admin=admin)
        return await under_lock(service, service.acting_owner, namespace, who, admin=admin)

    async def _candidates(self, scope: Scope, namespace: str) -> Response:
        try:
            owner = await self._owner(scope, namespace)
            return await run_in_threadpool(candidates_read, self.node, namespace, owner)
        except TierCkptError as e:
            return error_response("GET", scope["path"], e)

    async def _answer(self, scope: Scope, receive: Receive, namespace: str, step: int) -> Response:
        path = scope["path"]
        try:
            body = await _body(receive, path)
            req = ReadRequest.model_validate_json(body) if body.strip() else ReadRequest()
        except ValidationError as e:  # (located in the body, as the framework says it)
            return invalid_request(
                path, [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
            )
        except _TooLarge as e:  # the rest of the body unread: the connection closes
            return JSONResponse(
                {"code": ProtocolError.code, "detail": str(e)},
                status_code=413,
                headers={"Connection": "close"},
            )
        except TierCkptError as e:
            return error_response("POST", path, e)
        try:
            owner = await self._owner(scope, namespace)
            return await read_response(self.node.service, self.node, namespace, step, owner, req)
        except TierCkptError as e:
            return error_response("POST", path, e)


class _TooLarge(ProtocolError):
    pass


async def _body(receive: Receive, path: str) -> bytes:
    """The request's body, refused past :data:`BODY_MAX` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            raise ProtocolError(f"{path}: the request ended before its body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > BODY_MAX:
            raise _TooLarge(f"{path}: a body of over {BODY_MAX} bytes is not a read request")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
