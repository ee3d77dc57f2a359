"""``tierckpt-webhook``: serve the pod mutation to the Kubernetes API server over HTTPS.

Standard library only: the API server sends one small JSON document per pod creation, so a
threading ``http.server`` is plenty, and the daemon's image runs it without another dependency.
The certificate and key come from files (a ``kubernetes.io/tls`` Secret mounted by the chart, e.g.
issued by cert-manager); they are re-read when they change, so a rotated certificate needs no
restart.

Anyone who reaches the port can connect, so nothing a client does may take the server down or
out of memory (the chart gives it 128 MiB): at most ``--max-connections`` connections are served
at once, by as many reused worker threads, and further ones wait in the kernel's listen queue (no
thread, no memory of ours) until one is done; each request must arrive whole, TLS handshake
included, within ``--request-timeout`` of the connection's start or of the previous answer (one
deadline for the request, not per read: a client trickling a byte at a time is cut off too);
heads and bodies are capped (bodies refused unread above the cap), bodies being read share a byte
budget, and one body is parsed at a time. Malformed input gets an answer (an AdmissionReview
refusal naming the problem, or 400 when there is no request uid to answer to), never a traceback.
"""

from __future__ import annotations

import argparse
import builtins
import json
import logging
import os
import queue
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

from tierckpt_webhook.mutate import (
    BadReview,
    InjectSettings,
    admission_response,
    parse_review,
)

logger = logging.getLogger(__name__)

# An AdmissionReview of a pod is a few KiB; a CREATE review holds one object, and etcd stores
# objects up to 1.5 MiB. Parsed JSON takes up to ~15x its size (crafted scalars; containers are
# capped, see mutate.MAX_CONTAINERS): the cap, a budget of two such bodies held at once and one
# parse at a time keep a hostile client's worst (~70 MiB measured) within the chart's 128 MiB.
MAX_BODY = 2 << 20
BODY_BUDGET = 2 * MAX_BODY
MAX_CONNECTIONS = 64  # API server calls take milliseconds; 64 threads are ~10 MiB
REQUEST_TIMEOUT_S = 5.0  # a whole request (the webhook's own timeoutSeconds defaults to 5)
IO_TIMEOUT_S = 10.0  # writing the answer
# The request line and headers (http.server alone would take 100 lines of 64 KiB each).
HEAD_LIMIT = 64 << 10


class _DeadlineSocket(ssl.SSLSocket):
    """A TLS socket whose reads (handshake included) share one deadline, and a byte allowance,
    both set per request.

    Each read's timeout is the time left (the ssl module applies a timeout to a whole read or
    handshake call), so a client sending a byte every few seconds runs out of time like one that
    sends nothing. Reads stop at ``limit`` bytes received: the head's allowance plus the body's
    declared length, so no client makes a connection hold more.
    """

    deadline = float("inf")
    received = 0
    limit = HEAD_LIMIT

    def start_request(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.limit = self.received + HEAD_LIMIT

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within its deadline")
        self.settimeout(min(left, IO_TIMEOUT_S))

    def do_handshake(self, block: bool = False) -> None:
        self._arm()
        super().do_handshake(block)

    def read(self, len: int = 1024, buffer: Any = None) -> Any:
        self._arm()
        allowed = min(len, self.limit - self.received)
        if allowed <= 0:
            raise ConnectionAbortedError(f"request head over {HEAD_LIMIT} bytes")
        got = super().read(allowed, buffer)
        self.received += got if isinstance(got, int) else builtins.len(got)
        return got

    def sendall(self, data: Any, flags: int = 0) -> None:
        self.settimeout(IO_TIMEOUT_S)
        super().sendall(data, flags)


class _Budget:
    """Bytes of request bodies held at once: a body waits (until its request's deadline) for room."""

    def __init__(self, total: int) -> None:
        self._free = total
        self._cond = threading.Condition()

    def take(self, n: int, deadline: float) -> bool:
        with self._cond:
            while self._free < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self._free -= n
            return True

    def give(self, n: int) -> None:
        with self._cond:
            self._free += n
            self._cond.notify_all()


class _Tls:
    """An SSL context that follows the certificate files (cert-manager rotates them in place)."""

    def __init__(self, cert: Path, key: Path) -> None:
        self._cert, self._key = cert, key
        self._lock = threading.Lock()
        self._stamp: tuple[float, float] | None = None
        self._context = self._load()

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self._cert, self._key)
        context.sslsocket_class = _DeadlineSocket
        self._stamp = (self._cert.stat().st_mtime, self._key.stat().st_mtime)
        return context

    def context(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = (self._cert.stat().st_mtime, self._key.stat().st_mtime)
                if stamp != self._stamp:
                    self._context = self._load()
                    logger.info("reloaded the TLS certificate %s", self._cert)
            except (OSError, ssl.SSLError) as e:
                # Half-written files during a rotation: keep serving the previous certificate.
                logger.warning("cannot reload the TLS certificate %s: %s", self._cert, e)
            return self._context


class WebhookServer(HTTPServer):
    """Connections are served by at most ``max_connections`` worker threads, started as needed and
    reused (not a thread per connection: the count never exceeds the limit, even for a moment)."""

    # Connections beyond max_connections wait here, in the kernel, until a worker is free.
    request_queue_size = 256

    def __init__(
        self,
        address: tuple[str, int],
        tls: _Tls,
        settings: InjectSettings,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        super().__init__(address, _Handler)
        self.tls = tls
        self.settings = settings
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        self.bodies = _Budget(BODY_BUDGET)
        self.parsing = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._work: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self._workers_lock = threading.Lock()
        self._idle_workers = 0
        self._full_logged = 0.0

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        sock.settimeout(IO_TIMEOUT_S)
        tls = self.tls.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return tls, addr

    def process_request(self, request: Any, client_address: Any) -> None:
        # In the accept loop: waiting here for a free slot leaves the next connections in the
        # listen queue, where they cost no thread (and their deadline has not started).
        if not self._slots.acquire(blocking=False):
            now = time.monotonic()
            if now - self._full_logged > 60:
                self._full_logged = now
                logger.warning(
                    "all %d connections busy: new ones wait (slow or idle clients are cut off "
                    "after %gs)",
                    self.max_connections,
                    self.request_timeout_s,
                )
            self._slots.acquire()
        with self._workers_lock:
            start = self._idle_workers == 0  # then fewer than max_connections workers exist
            if not start:
                self._idle_workers -= 1
        self._work.put((request, client_address))
        if start:
            threading.Thread(target=self._worker, name="webhook-worker", daemon=True).start()

    def _worker(self) -> None:
        while True:
            request, client_address = self._work.get()
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                with self._workers_lock:
                    self._idle_workers += 1
                self._slots.release()

    def finish_request(self, request: Any, client_address: Any) -> None:
        # In the request's own thread: a slow or broken client cannot hold up accept().
        request.start_request(self.request_timeout_s)
        try:
            request.do_handshake()
        except (OSError, ssl.SSLError) as e:
            logger.warning("TLS handshake with %s failed: %s", client_address[0], e)
            return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that vanished or broke the protocol mid-answer is not a server error.
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            logger.info("connection from %s ended: %s", client_address[0], error)
        else:
            logger.error("error serving %s", client_address[0], exc_info=error)


def _printable(value: Any) -> str:
    text = value if isinstance(value, str) else ""
    return text[:253] if text.isprintable() else repr(text[:253])


def _pod_name(review: dict[str, Any]) -> str:
    """namespace/name of the reviewed pod, for the log (fields the client sent: checked)."""
    request = review["request"]
    obj = request.get("object")
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    name = meta.get("generateName") or meta.get("name") or request.get("name")
    return f"{_printable(request.get('namespace'))}/{_printable(name)}"


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s", self.address_string(), format % args)

    def handle(self) -> None:
        # BaseHTTPRequestHandler.handle, with a new deadline for each request on the connection
        # (the first one's started with the connection, covering the handshake).
        self.close_connection = True
        self.handle_one_request()
        while not self.close_connection:
            self.connection.start_request(self.server.request_timeout_s)
            self.handle_one_request()

    def _reply(self, status: int, body: dict[str, Any], close: bool = False) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:  # e.g. a body left unread: the rest of the stream is not a next request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(200, {"ok": True})
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        if self.path != "/mutate":
            self._reply(404, {"error": f"no route {self.path}"}, close=True)
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(411, {"error": "Content-Length required"}, close=True)
            return
        if not 0 < length <= MAX_BODY:
            self._reply(413, {"error": f"body of {length} bytes (at most {MAX_BODY})"}, close=True)
            return
        if not self.server.bodies.take(length, self.connection.deadline):
            self._reply(503, {"error": "busy: too many large bodies at once"}, close=True)
            return
        try:
            self.connection.limit += length
            body = self.rfile.read(length)
            # One parse at a time, and the parsed review dropped before the lock is: a crafted
            # body of 3 MiB parses to ~100 MiB of objects; two at once would not fit.
            with self.server.parsing:
                status, answer = _answer(body, self.server.settings)
                del body
        finally:
            self.server.bodies.give(length)
        self._reply(status, answer)


def _answer(body: bytes, settings: InjectSettings) -> tuple[int, dict[str, Any]]:
    """The HTTP status and answer for a request body (the review is parsed and dropped here)."""
    try:
        review = parse_review(body)
        answer = admission_response(review, settings)
    except BadReview as e:
        return 400, {"error": f"bad AdmissionReview: {e}"}
    response = answer["response"]
    logger.info(
        "pod %s: %s",
        _pod_name(review),
        "patched" if "patch" in response else ("left alone" if response["allowed"] else "refused"),
    )
    return 200, answer


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    parser = argparse.ArgumentParser(
        prog="tierckpt-webhook",
        description="Mutating admission webhook that onboards trainer pods labelled "
        'tierckpt.io/inject: "true" (hostPath tier directory, daemon group, TIERCKPT_SOCKET).',
    )
    parser.add_argument("--host", default=env("TIERCKPT_WEBHOOK_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(env("TIERCKPT_WEBHOOK_PORT", "8443")))
    parser.add_argument(
        "--tls-cert", type=Path, default=Path(env("TIERCKPT_WEBHOOK_TLS_CERT", "/tls/tls.crt"))
    )
    parser.add_argument(
        "--tls-key", type=Path, default=Path(env("TIERCKPT_WEBHOOK_TLS_KEY", "/tls/tls.key"))
    )
    parser.add_argument(
        "--shm-dir",
        default=env("TIERCKPT_SHM_DIR", InjectSettings.shm_dir),
        help="the daemons' tier directory (hostPath) holding daemon.sock",
    )
    parser.add_argument(
        "--group",
        type=int,
        default=int(env("TIERCKPT_GROUP", str(InjectSettings.group))),
        help="the daemons' group id, added to the pods' supplementalGroups",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=int(env("TIERCKPT_WEBHOOK_MAX_CONNECTIONS", str(MAX_CONNECTIONS))),
        help="connections served at once; more wait in the listen queue",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=float(env("TIERCKPT_WEBHOOK_REQUEST_TIMEOUT_S", str(REQUEST_TIMEOUT_S))),
        help="seconds for a whole request to arrive (TLS handshake included); slower ones are cut off",
    )
    parser.add_argument("--log-level", default=env("TIERCKPT_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        tls = _Tls(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as e:
        print(f"tierckpt-webhook: cannot load the TLS certificate/key: {e}", file=sys.stderr)
        return 2
    settings = InjectSettings(shm_dir=args.shm_dir, group=args.group)
    if args.max_connections < 1 or args.request_timeout <= 0:
        parser.error("--max-connections must be >= 1 and --request-timeout > 0")
    server = WebhookServer(
        (args.host, args.port), tls, settings, args.max_connections, args.request_timeout
    )
    logger.info(
        "serving on https://%s:%d/mutate (tier %s, group %d)",
        args.host,
        server.server_address[1],
        settings.shm_dir,
        settings.group,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
