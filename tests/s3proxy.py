"""A loopback HTTP proxy in front of a real S3 server that injects faults, for reliability tests.

Real S3 fails in a handful of ways: throttling (503 SlowDown), internal errors (500), connections
reset mid-request, bodies cut short, slow responses and servers that stop answering. This proxy
relays HTTP/1.1 byte for byte (headers untouched, so SigV4 signatures stay valid) between the
clients under test (the CRT client, boto3) and SeaweedFS, and injects those faults per request by
rule: ``proxy.add(Fault("503"), op="UploadPart", times=2)``. It classifies each request as an S3
operation (``UploadPart``, ``GetObject``, ...) so that rules and counters speak S3.

One thread per client connection, 127.0.0.1 only. ``stall`` faults hold their connection without
reading or answering until the proxy is closed or :meth:`S3FaultProxy.release` is called, like a
server stopped with SIGSTOP.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

_BUF = 256 * 1024
_MAX_HEAD = 64 * 1024

_ERROR_BODIES = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
    403: ("AccessDenied", "Access Denied"),  # what a policy that lacks the action answers
}


@dataclass
class Fault:
    """What to do to a request.

    kind: ``"503"``/``"500"``/``"403"`` (answer with that S3 error, never forwarding), ``"reset"`` (reset
    the connection after reading the request head), ``"reset_body"`` (forward half the request
    body, then reset both sides), ``"truncate"`` (forward, then send the response's headers and
    half its body, then reset), ``"short"`` (forward, then send a well-formed response whose body
    and Content-Length are cut to half: a server that lies), ``"flip"`` (flip one byte of the
    response body), ``"deny_each"`` (answer a DeleteObjects with 200 and AccessDenied for each
    key, never forwarding), ``"flip_body"`` (flip one byte of the request body on its way to the server,
    which over plain HTTP with unsigned payloads stores it), ``"delay"`` (wait ``seconds`` before forwarding), ``"stall"`` (stop reading
    and answering, hold the connection).
    """

    kind: str
    seconds: float = 0.0


@dataclass
class Rule:
    fault: Fault
    op: str | None = None  # S3 operation name (see classify), None: any
    key: str | None = None  # regex searched in the request path, None: any
    times: int | None = None  # apply to this many matching requests, then stop; None: forever
    skip: int = 0  # let this many matching requests through first
    hits: int = 0

    def matches(self, op: str, path: str) -> bool:
        if self.op is not None and self.op != op:
            return False
        return self.key is None or re.search(self.key, path) is not None


@dataclass
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    op: str = ""
    path: str = ""

    def header(self, name: str) -> str | None:
        low = name.lower()
        for k, v in self.headers:
            if k.lower() == low:
                return v
        return None


def classify(method: str, target: str) -> tuple[str, str]:
    """The S3 operation of a path-style request, and its path."""
    parts = urlsplit(target)
    q = parse_qs(parts.query, keep_blank_values=True)
    path = parts.path
    has_key = path.strip("/").count("/") >= 1
    if method == "PUT":
        return ("UploadPart" if "partNumber" in q else "PutObject"), path
    if method == "POST":
        if "uploads" in q:
            return "CreateMultipartUpload", path
        if "uploadId" in q:
            return "CompleteMultipartUpload", path
        if "delete" in q:
            return "DeleteObjects", path
        return "Post", path
    if method == "GET":
        return ("GetObject" if has_key else "ListObjects"), path
    if method == "HEAD":
        return ("HeadObject" if has_key else "HeadBucket"), path
    if method == "DELETE":
        return ("AbortMultipartUpload" if "uploadId" in q else "DeleteObject"), path
    return method, path


class _Closed(Exception):
    """A side of the relay went away."""


class S3FaultProxy:
    """``start()``, point clients at ``endpoint``, ``add(...)`` rules, read ``counts``, ``close()``."""

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        assert u.hostname == "127.0.0.1" and u.port, upstream
        self.upstream = (u.hostname, u.port)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._conns: set[socket.socket] = set()
        self._released = threading.Event()
        self._closed = False
        self.requests: Counter[str] = Counter()  # S3 operation -> requests seen
        self.faults: Counter[str] = Counter()  # "kind op" -> faults injected
        self.log: list[tuple[float, str, str, str]] = []  # (time, op, path, fault or "")
        self._thread = threading.Thread(target=self._accept, name="s3proxy", daemon=True)

    def start(self) -> S3FaultProxy:
        self._thread.start()
        return self

    def add(
        self,
        fault: Fault | str,
        *,
        op: str | None = None,
        key: str | None = None,
        times: int | None = None,
        skip: int = 0,
    ) -> Rule:
        rule = Rule(Fault(fault) if isinstance(fault, str) else fault, op, key, times, skip)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        """Drop every rule (stalled connections stay stalled until :meth:`release`)."""
        with self._lock:
            self._rules.clear()

    def release(self) -> None:
        """Let stalled connections go: they are reset, as when a stopped server is killed."""
        self._released.set()

    def injected(self) -> int:
        with self._lock:
            return sum(self.faults.values())

    def close(self) -> None:
        self._closed = True
        self._released.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _reset(c)
        self._thread.join(timeout=5)

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- relay ---------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _pick(self, req: Request) -> Fault | None:
        with self._lock:
            self.requests[req.op] += 1
            chosen: Fault | None = None
            for rule in self._rules:
                if chosen is not None or not rule.matches(req.op, req.path):
                    continue
                rule.hits += 1
                if rule.hits <= rule.skip:
                    continue
                if rule.times is not None and rule.hits > rule.skip + rule.times:
                    continue
                chosen = rule.fault
            if chosen is not None:
                self.faults[f"{chosen.kind} {req.op}"] += 1
            self.log.append((time.monotonic(), req.op, req.path, chosen.kind if chosen else ""))
            return chosen

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            crd = client.makefile("rb", buffering=_BUF)
            while True:
                req = _read_request(crd)
                if req is None:
                    return
                req.op, req.path = classify(req.method, req.target)
                fault = self._pick(req)
                kind = fault.kind if fault else ""
                if kind == "stall":
                    self._released.wait()
                    _reset(client)
                    return
                if kind == "reset":
                    _reset(client)
                    return
                expect = (req.header("Expect") or "").lower() == "100-continue"
                if kind in ("500", "503", "403"):
                    client.sendall(_error_response(int(kind)))
                    if expect:  # the body never comes: this connection cannot be reused
                        return
                    _read_body(crd, req.headers, None)  # consume it: the connection stays usable
                    continue
                if kind == "deny_each" and (n := _content_length(req.headers)) is not None:
                    if expect:
                        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    client.sendall(_denied_each(_read_exact(crd, n)))
                    continue
                if kind == "delay" and fault is not None:
                    time.sleep(fault.seconds)
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=120)
                    urd = upstream.makefile("rb", buffering=_BUF)
                upstream.sendall(_head_bytes(f"{req.method} {req.target} HTTP/1.1", req.headers))
                if expect:
                    first = _read_line(urd).decode("latin-1").rstrip("\r\n")
                    interim = _read_headers(urd)
                    if first.split()[1] != "100":
                        self._relay_response(req, first, interim, urd, client, "")
                        return
                    client.sendall(_head_bytes(first, interim))
                if kind == "reset_body":
                    _read_body(crd, req.headers, upstream, cut=True)
                    _reset(client)
                    _reset(upstream)
                    return
                if kind == "flip_body" and (n := _content_length(req.headers)):
                    body = bytearray(_read_exact(crd, n))
                    body[n // 2] ^= 0x01
                    upstream.sendall(bytes(body))
                else:
                    _read_body(crd, req.headers, upstream)
                status, rhead = _read_response_head(urd)
                keep = self._relay_response(req, status, rhead, urd, client, kind)
                if not keep:
                    return
        except (_Closed, OSError):
            return
        finally:
            with self._lock:
                self._conns.discard(client)
            with contextlib.suppress(OSError):
                client.close()
            if upstream is not None:
                with contextlib.suppress(OSError):
                    upstream.close()

    def _relay_response(
        self,
        req: Request,
        status_line: str,
        headers: list[tuple[str, str]],
        urd: object,
        client: socket.socket,
        kind: str,
    ) -> bool:
        code = int(status_line.split()[1])
        no_body = req.method == "HEAD" or code in (204, 304)
        length = None if no_body else _content_length(headers)
        if kind in ("truncate", "short", "flip") and length is not None and length > 1:
            body = _read_exact(urd, length)
            if kind == "flip":
                flipped = bytearray(body)
                flipped[len(body) // 2] ^= 0x01
                client.sendall(_head_bytes(status_line, headers) + bytes(flipped))
                return True
            half = body[: length // 2]
            if kind == "short":
                cut = [
                    (k, str(len(half)) if k.lower() == "content-length" else v) for k, v in headers
                ]
                client.sendall(_head_bytes(status_line, cut) + half)
                return True
            client.sendall(_head_bytes(status_line, headers) + half)
            _reset(client)
            return False
        client.sendall(_head_bytes(status_line, headers))
        if no_body:
            return True
        if length is not None:
            _copy(urd, client, length)
            return True
        if _chunked(headers):
            _copy_chunked(urd, client)
            return True
        while data := urd.read1(_BUF):  # type: ignore[attr-defined]
            client.sendall(data)
        return False


def _reset(s: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a crashed peer or a middlebox does."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


def _read_line(rd: object) -> bytes:
    line: bytes = rd.readline(_MAX_HEAD)  # type: ignore[attr-defined]
    if not line.endswith(b"\n"):
        raise _Closed()
    return line


def _read_headers(rd: object) -> list[tuple[str, str]]:
    headers = []
    while True:
        line = _read_line(rd).rstrip(b"\r\n")
        if not line:
            return headers
        k, _, v = line.decode("latin-1").partition(":")
        headers.append((k, v.strip()))


def _read_request(rd: object) -> Request | None:
    line: bytes = rd.readline(_MAX_HEAD)  # type: ignore[attr-defined]
    if not line:
        return None
    if not line.endswith(b"\n"):
        raise _Closed()
    method, target, _version = line.decode("latin-1").split()
    return Request(method, target, _read_headers(rd))


def _read_response_head(rd: object) -> tuple[str, list[tuple[str, str]]]:
    while True:
        status = _read_line(rd).decode("latin-1").rstrip("\r\n")
        headers = _read_headers(rd)
        if not status.split()[1].startswith("1"):  # skip interim responses (100 Continue)
            return status, headers


def _head_bytes(first: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [first, *(f"{k}: {v}" for k, v in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1")


def _content_length(headers: list[tuple[str, str]]) -> int | None:
    for k, v in headers:
        if k.lower() == "content-length":
            return int(v)
    return None


def _chunked(headers: list[tuple[str, str]]) -> bool:
    return any(k.lower() == "transfer-encoding" and "chunked" in v.lower() for k, v in headers)


def _read_exact(rd: object, n: int) -> bytes:
    data: bytes = rd.read(n)  # type: ignore[attr-defined]
    if len(data) != n:
        raise _Closed()
    return data


def _copy(rd: object, dst: socket.socket | None, n: int, limit: int | None = None) -> None:
    sent = 0
    stop = n if limit is None else min(n, limit)
    while sent < stop:
        data: bytes = rd.read1(min(_BUF, stop - sent))  # type: ignore[attr-defined]
        if not data:
            raise _Closed()
        if dst is not None:
            dst.sendall(data)
        sent += len(data)


def _copy_chunked(rd: object, dst: socket.socket | None) -> None:
    while True:
        size_line = _read_line(rd)
        if dst is not None:
            dst.sendall(size_line)
        size = int(size_line.split(b";")[0].strip(), 16)
        if size == 0:
            while True:  # trailers, then the empty line
                line = _read_line(rd)
                if dst is not None:
                    dst.sendall(line)
                if line in (b"\r\n", b"\n"):
                    return
        _copy(rd, dst, size + 2)


def _read_body(
    rd: object, headers: list[tuple[str, str]], dst: socket.socket | None, cut: bool = False
) -> None:
    """Relay (or, with ``dst`` None, consume) a request body; ``cut``: only its first half."""
    length = _content_length(headers)
    if length is not None:
        _copy(rd, dst, length, limit=length // 2 if cut else None)
    elif _chunked(headers):
        _copy_chunked(rd, dst)


def _denied_each(body: bytes) -> bytes:
    """A DeleteObjects answer that refuses every key (200, an AccessDenied error per key: what S3
    answers a policy that lacks s3:DeleteObject)."""
    keys = re.findall(rb"<Key>(.*?)</Key>", body)
    errors = "".join(
        f"<Error><Key>{k.decode()}</Key><Code>AccessDenied</Code>"
        "<Message>Access Denied</Message></Error>"
        for k in keys
    )
    payload = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{errors}</DeleteResult>'
    ).encode()
    headers = [
        ("Content-Type", "application/xml"),
        ("Content-Length", str(len(payload))),
        ("x-amz-request-id", "tierckpt-proxy"),
    ]
    return _head_bytes("HTTP/1.1 200 OK", headers) + payload


def _error_response(status: int) -> bytes:
    code, message = _ERROR_BODIES[status]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<RequestId>tierckpt-proxy</RequestId></Error>"
    ).encode()
    reason = {503: "Slow Down", 403: "Forbidden"}.get(status, "Internal Server Error")
    headers = [
        ("Content-Type", "application/xml"),
        ("Content-Length", str(len(body))),
        ("x-amz-request-id", "tierckpt-proxy"),
    ]
    return _head_bytes(f"HTTP/1.1 {status} {reason}", headers) + body
