"""The handoff message, trainer <-> daemon on the daemon's second Unix socket
(:func:`tierckpt_core.protocol.handoff_socket`; served by :mod:`tierckpt_daemon.peers.handoff`).

One JSON line each way. The trainer asks for bytes ``[start, stop)`` of one file of a peer's copy
of a step (:class:`HandoffRequest`); the daemon answers ``{"ok": true}`` with the connection to
the peer attached (``SCM_RIGHTS``), or ``{"ok": false, "code": ..., "detail": ...}``
(:class:`HandoffAnswer`). Both sides build and read the lines here, so that neither writes the
message out by hand. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from tierckpt_core.errors import InvalidNameError, ProtocolError, TierCkptError, error_from_code
from tierckpt_core.names import (
    MAX_FILE_BYTES,
    validate_attempt,
    validate_file_name,
    validate_namespace,
    validate_step,
)


def _object(line: bytes | bytearray, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(line)
    except ValueError as e:
        raise ProtocolError(f"{what}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"{what}: not a JSON object")
    return doc


@dataclass(frozen=True)
class HandoffRequest:
    """Bytes ``[start, stop)`` of file ``file`` of ``peer``'s copy ``attempt`` of ``namespace/step``.

    Which peers may be named is the daemon's to check (its ring), not this model's."""

    peer: str
    namespace: str
    step: int
    attempt: str
    file: str
    start: int
    stop: int

    def line(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes | bytearray) -> HandoffRequest:
        """The request on ``line``; ProtocolError ("handoff request: ...") naming what is wrong
        (names are checked as the API checks them: they end up in a peer's URL)."""
        doc = _object(line, "handoff request")
        try:
            namespace = validate_namespace(doc.get("namespace"))
            step = validate_step(doc.get("step"))
            attempt = validate_attempt(doc.get("attempt"))
            name = validate_file_name(doc.get("file"))
        except InvalidNameError as e:
            raise ProtocolError(f"handoff request: {e}") from None
        start, stop, peer = doc.get("start"), doc.get("stop"), doc.get("peer")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop)):
            raise ProtocolError("handoff request: start and stop must be integers")
        assert isinstance(start, int) and isinstance(stop, int)
        if not 0 <= start < stop <= MAX_FILE_BYTES:
            raise ProtocolError(f"handoff request: bad range {start}-{stop}")
        if not isinstance(peer, str):
            raise ProtocolError(f"handoff request: peer {peer!r} is not a peer's host:port")
        return cls(peer, namespace, step, attempt, name, start, stop)


@dataclass(frozen=True)
class HandoffAnswer:
    """``ok`` (the connection comes with the line), or the error's stable ``code`` and detail."""

    ok: bool
    code: str | None = None
    detail: str | None = None

    @classmethod
    def failed(cls, e: TierCkptError) -> HandoffAnswer:
        return cls(False, e.code, str(e))

    def line(self) -> bytes:
        doc = (
            {"ok": self.ok} if self.ok else {"ok": False, "code": self.code, "detail": self.detail}
        )
        return json.dumps(doc).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes | bytearray, what: str) -> HandoffAnswer:
        doc = _object(line, f"{what}: the daemon's answer")
        if doc.get("ok"):
            return cls(True)
        return cls(False, str(doc.get("code")), str(doc.get("detail")))

    def error(self) -> TierCkptError | None:
        """The daemon's error, as its class (by ``code``); None if the answer is ok."""
        if self.ok:
            return None
        return error_from_code(str(self.code), str(self.detail))
