"""Decoding a daemon's HTTP answers, for the trainer's client and for daemon-to-daemon calls.

A daemon answers JSON; errors are ``{"code": "...", "detail": "..."}`` with a stable ``code`` that
:func:`~tierckpt_core.errors.error_from_code` maps back to the exception class.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tierckpt_core.errors import ProtocolError, error_from_code


def decode_response(resp: httpx.Response, what: str, *, prefix: str = "") -> Any:
    """The JSON body of a daemon's answer, or its ``{"code", "detail"}`` error raised as the
    matching exception class (``prefix`` goes before the detail). ``what`` names the answer in a
    ProtocolError, e.g. ``"daemon answered GET /v1/status"``."""
    return decode_body(resp.status_code, resp.content, what, prefix=prefix)


def decode_body(status: int, content: bytes, what: str, *, prefix: str = "") -> Any:
    """:func:`decode_response` for an answer's status and body (the trainer's own transport)."""
    try:
        doc = json.loads(content)
    except ValueError:
        raise ProtocolError(f"{what} with HTTP {status} and a non-JSON body") from None
    if status >= 400:
        if isinstance(doc, dict) and "code" in doc and "detail" in doc:
            raise error_from_code(str(doc["code"]), f"{prefix}{doc['detail']}")
        raise ProtocolError(f"{what} with HTTP {status}: {doc}")
    return doc
