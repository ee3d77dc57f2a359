"""The TCP port's gate: a peer route's token is checked, and every request's body is capped,
before a byte of the body is read.

Why a middleware and not a FastAPI dependency: FastAPI reads and parses a route's whole JSON body
before it runs the route's dependencies, so with the token checked there, anyone who reached the
port could make the daemon hold a body of any size (one 200 MiB body without a token took it from
60 to 658 MiB, and the memory it is charged for includes the tier's tmpfs pages). Here the headers
alone decide: no or a wrong token is a 401, a ``Content-Length`` over the route's cap a 413, both
answered with ``Connection: close`` and the body unread. A body without a length (chunked) is
counted as it arrives and cut off at the cap, also with a 413.

Caps (settings): ``TIERCKPT_PEER_MAX_RECORD_BYTES`` for a commit record (``prepare`` and the
decision, which carry the job's metadata and block checksums: tens of MB for a large job), and
``TIERCKPT_PEER_MAX_BODY_BYTES`` for every other request on the TCP port (a ``pull`` is a line).
Replicas travel as responses to GETs, not as request bodies: no cap applies to them here.
"""

from __future__ import annotations

import hmac
import json

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierckpt_core.errors import (
    ForbiddenError,
    ProtocolError,
    TierCkptError,
    UnauthorizedError,
)

PEER_PREFIX = "/v1/peer/"
# The routes whose body is a commit record (api/peers.py): POST .../attempts/{attempt}/<verb>.
RECORD_VERBS = ("prepare", "commit")


def check_peer_token(secret: SecretStr | None, header: str | None) -> None:
    """Raise unless ``header`` (the request's ``Authorization``) presents ``secret``."""
    if secret is None:
        raise ForbiddenError(
            "replication is off on this daemon (no TIERCKPT_PEERS / TIERCKPT_PEER_TOKEN), so it "
            "serves no peer routes"
        )
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


class BodyTooLarge(HTTPException):
    """A body without a length that grew past its route's cap. An ``HTTPException`` because
    FastAPI lets those out of its body reading as they are (anything else it turns into a 400);
    the app's handler answers it in the daemon's error shape."""

    def __init__(self, detail: str) -> None:
        super().__init__(413, detail, headers={"Connection": "close"})


class PeerGate:
    """ASGI middleware, inside :class:`~tierckpt_daemon.api.app.LocalOnlyGuard` (which has
    already refused local routes over TCP and peer routes on the Unix socket, also unread)."""

    def __init__(
        self, app: ASGIApp, secret: SecretStr | None, max_record_bytes: int, max_body_bytes: int
    ) -> None:
        self.app = app
        self.secret = secret
        self.max_record_bytes = max_record_bytes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if scope["type"] != "http" or server is None or server[1] is None:
            await self.app(scope, receive, send)  # the Unix socket: local clients
            return
        path: str = scope["path"]
        headers = Headers(scope=scope)
        if path.startswith(PEER_PREFIX):
            try:
                check_peer_token(self.secret, headers.get("authorization"))
            except TierCkptError as e:
                await _refuse(e.http_status, e.code, str(e), send)
                return
        limit, setting = self._limit(scope["method"], path)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            detail = _too_large(path, limit, setting, int(length))
            await _refuse(413, ProtocolError.code, detail, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, _capped(receive, path, limit, setting), tracked)
        except BodyTooLarge as e:  # not answered inside (FastAPI answers it as it reads)
            if started:
                raise
            await _refuse(413, ProtocolError.code, e.detail, send)

    def _limit(self, method: str, path: str) -> tuple[int, str]:
        """The cap on a request's body, and the setting that sets it."""
        head, _, verb = path.rpartition("/")
        if (
            path.startswith(PEER_PREFIX)
            and method == "POST"
            and verb in RECORD_VERBS
            and head.rpartition("/")[0].endswith("/attempts")
        ):
            return self.max_record_bytes, "TIERCKPT_PEER_MAX_RECORD_BYTES"
        return self.max_body_bytes, "TIERCKPT_PEER_MAX_BODY_BYTES"


def _capped(receive: Receive, path: str, limit: int, setting: str) -> Receive:
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(_too_large(path, limit, setting, None))
        return message

    return counted


def _too_large(path: str, limit: int, setting: str, length: int | None) -> str:
    size = f" ({length} bytes)" if length is not None else ""
    return (
        f"{path}: the request's body{size} is over this daemon's limit of {limit} bytes for "
        f"it ({setting})"
    )


async def _refuse(status: int, code: str, detail: str, send: Send) -> None:
    """Answer without reading the body, and close the connection: the body, if the client goes
    on sending it, is not read either."""
    body = json.dumps({"code": code, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
