"""Errors as every route answers them."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from fastapi.responses import JSONResponse

from tierckpt_core.errors import ProtocolError, TierCkptError

logger = logging.getLogger("tierckpt_daemon.api.app")  # where these warnings always were


def error_response(method: str, path: str, exc: TierCkptError) -> JSONResponse:
    """A :class:`TierCkptError` as every route answers it: its status, ``{"code", "detail"}``
    (``ErrorBody``); one the daemon's side caused (5xx) is logged as a warning."""
    if exc.http_status >= 500:
        logger.warning("%s %s failed: %s", method, path, exc)
    headers = {"WWW-Authenticate": "Bearer"} if exc.http_status == 401 else None
    return JSONResponse(
        {"code": exc.code, "detail": str(exc)}, status_code=exc.http_status, headers=headers
    )


def invalid_request(path: str, errors: Iterable[Mapping[str, Any]]) -> JSONResponse:
    """A request that is not what its route takes: 422, each error as ``location: message``."""
    parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in errors]
    detail = f"invalid request to {path}: " + "; ".join(parts)
    return JSONResponse({"code": ProtocolError.code, "detail": detail}, status_code=422)
