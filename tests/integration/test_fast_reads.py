"""A load's two requests (``POST .../reads``, ``GET .../candidates?read=true``) are answered before
the framework's routing (``tierckpt_daemon.api.fast_reads``): the same answers as the framework's
routes, the same errors, the same refusals; what the fast path does not take reaches the
framework as before."""

from __future__ import annotations

import json
from typing import Any

from tierckpt_client._uds_http import UnixHTTP

from helpers import DaemonProcess
from kit import save, seeded_state

NS = "fast"


def _ask(node: DaemonProcess, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    http = UnixHTTP(node.socket, 5.0)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        status, content = http.request(method, path, data, 10.0)
    finally:
        http.close()
    return status, json.loads(content)


def test_the_answers_are_the_framework_routes_answers(client_env: DaemonProcess) -> None:
    save(NS, 1, seeded_state(1, 1024))
    save(NS, 2, seeded_state(2, 1024))
    reads = f"/v1/namespaces/{NS}/steps/2/reads"
    fast = _ask(client_env, "POST", reads, {"pin": False})
    routed = _ask(client_env, "POST", reads + "?via=framework", {"pin": False})  # not taken
    assert fast == routed and fast[0] == 200
    assert fast[1]["metadata"] and fast[1]["files"] and fast[1]["pin_id"] is None
    known = _ask(client_env, "POST", reads, {"pin": False, "known": fast[1]["version"]})
    assert known[0] == 200 and known[1]["metadata"] is None and known[1]["files"] is None
    # "read=1" is the framework's (it parses the flag); "read=true" the fast path's.
    cands = f"/v1/namespaces/{NS}/candidates"
    assert _ask(client_env, "GET", cands + "?read=true") == _ask(
        client_env, "GET", cands + "?read=1"
    )
    status, doc = _ask(client_env, "GET", cands + "?read=true")
    assert [c["step"] for c in doc["candidates"]] == [2, 1]
    assert doc["read"]["version"] == fast[1]["version"]
    # A pin through the fast path holds the step until it is released.
    status, pinned = _ask(client_env, "POST", reads, {})
    assert status == 200 and pinned["pin_id"] and pinned["paths"]
    http = UnixHTTP(client_env.socket, 5.0)
    assert (
        http.request("DELETE", f"/v1/namespaces/{NS}/steps/2/pins/{pinned['pin_id']}", None, 5)[0]
        == 204
    )
    http.close()


def test_errors_are_answered_as_every_route_answers_them(client_env: DaemonProcess) -> None:
    save(NS + "-e", 1, seeded_state(1, 1024))
    base = f"/v1/namespaces/{NS}-e"
    status, doc = _ask(client_env, "POST", f"{base}/steps/9/reads", {"pin": False})
    assert status == 404 and doc["code"] == "step_not_found" and "9" in doc["detail"]
    status, doc = _ask(client_env, "POST", "/v1/namespaces/nobody/steps/1/reads", {})
    assert status == 404 and doc["code"] == "namespace_not_found"
    status, doc = _ask(client_env, "POST", f"{base}/steps/1/reads", {"pin": "maybe"})
    assert status == 422 and doc["code"] == "protocol" and "body.pin" in doc["detail"]
    status, doc = _ask(client_env, "POST", f"{base}/steps/1/reads", b"{not json")
    assert status == 422 and doc["code"] == "protocol"
    status, doc = _ask(client_env, "POST", f"{base}/steps/1/reads", b" " * (65 << 10))
    assert status == 413 and doc["code"] == "protocol" and "read request" in doc["detail"]
    # Not the fast path's: the framework answers, in the same shape.
    status, doc = _ask(client_env, "POST", f"{base}/steps/x/reads", {})
    assert status == 422 and doc["code"] == "protocol"
    status, doc = _ask(client_env, "GET", "/v1/namespaces/nobody/candidates?read=true")
    assert status == 404 and doc["code"] == "namespace_not_found"


def test_the_fast_path_takes_only_its_two_requests_and_refuses_an_unknown_caller() -> None:
    """At the seam: which requests reach the framework (a stand-in app that records them), and
    that a request without the kernel's peer credentials (no caller) is refused, unanswered."""
    import asyncio

    from tierckpt_daemon.api.fast_reads import FastReads

    passed: list[str] = []

    async def framework(scope: Any, receive: Any, send: Any) -> None:
        passed.append(f"{scope['method']} {scope['path']}?{scope['query_string'].decode()}")
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    fast = FastReads(framework, node=None)  # type: ignore[arg-type]

    def ask(method: str, path: str, query: bytes = b"") -> int:
        sent: list[Any] = []

        async def receive() -> Any:
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {
            **{"type": "http", "method": method, "path": path, "query_string": query},
            **{"headers": [], "scheme": "http", "server": None, "root_path": ""},
        }
        asyncio.run(fast(scope, receive, send))
        return int(sent[0]["status"])

    assert ask("POST", "/v1/namespaces/a/steps/1/reads") == 403
    assert ask("GET", "/v1/namespaces/a/candidates", b"read=true") == 403
    assert not passed
    for method, path, query in (
        ("POST", "/v1/namespaces/a/steps/1/reads", b"x=1"),
        ("POST", "/v1/namespaces/a/steps/-1/reads", b""),
        ("POST", "/v1/namespaces/a/steps/1/pins", b""),
        ("GET", "/v1/namespaces/a/candidates", b""),
        ("GET", "/v1/namespaces/a/candidates", b"read=1"),
        ("GET", "/v1/namespaces/a/steps/1/reads", b""),
    ):
        assert ask(method, path, query) == 204
    assert len(passed) == 6
