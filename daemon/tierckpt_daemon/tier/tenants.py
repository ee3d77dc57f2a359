"""Who calls the daemon on its Unix socket, and which namespaces that caller may touch.

A namespace belongs to the identity that first committed it on a node: ``uid:<n>``, the Unix user
of the trainer, which the kernel vouches for (``SO_PEERCRED`` on the socket; no header a caller
could forge). The owner is written into every step's record and manifest, so it travels with
replicas and with copies a peer serves: a peer's copy of another owner's step never lands here,
never counts for "latest", and a local caller of another uid gets
:class:`~tierckpt_core.errors.NamespaceOwnerError` (403, code ``namespace_owner``). When every
trainer runs as one uid (single tenant) nothing changes and nothing is to be configured.

Administrators act on every namespace as its owner: uid 0 and the daemon's own uid (the operator's
``tierckpt`` CLI). Trainers that run as root are therefore administrators too: tenants that must
be kept apart need their own non-zero uids (``runAsUser``), the same uid for a tenant on every node.
See docs/security.md, "Tenants and namespace ownership".
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from tierckpt_core.errors import ForbiddenError

# Where a connection's caller is kept: its requests' ``scope["state"]`` (uvicorn copies the
# protocol's state into each request's scope, so every request on the connection sees it; the
# daemon's HTTP protocol, ``server.CallerH11Protocol``, puts it there).
STATE_KEY = "tierckpt.caller"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Caller:
    """A local client, as the kernel saw it connect."""

    pid: int
    uid: int
    gid: int

    @property
    def identity(self) -> str:
        return f"uid:{self.uid}"

    @property
    def admin(self) -> bool:
        """uid 0 and the daemon's own uid administer every namespace (the operator's CLI)."""
        return self.uid in (0, os.geteuid())


def caller_of(sock: Any) -> Caller | None:
    """The credentials of the process at the other end of a Unix socket (None on TCP)."""
    if sock is None or getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return Caller(pid=pid, uid=uid, gid=gid)


def request_caller(request: Request) -> Caller:
    """The local caller of ``request``; refused when the kernel did not say who it is."""
    caller = request.scope.get("state", {}).get(STATE_KEY)
    if not isinstance(caller, Caller):
        raise ForbiddenError(
            f"{request.url.path}: the daemon cannot tell which user is calling (no peer "
            "credentials on this connection); local routes are served on its Unix socket only"
        )
    return caller
