"""``tierckpt-webhook``: serve the pod mutation to the Kubernetes API server over HTTPS.

Standard library only: the API server sends one small JSON document per pod creation, so a
threading ``http.server`` is plenty, and the daemon's image runs it without another dependency.
The certificate and key come from files (a ``kubernetes.io/tls`` Secret mounted by the chart, e.g.
issued by cert-manager); they are re-read when they change, so a rotated certificate needs no
restart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tierckpt_daemon.webhook.mutate import InjectSettings, admission_response

logger = logging.getLogger(__name__)

MAX_BODY = 4 << 20  # an AdmissionReview of a pod is a few KiB; refuse anything absurd
IO_TIMEOUT_S = 10.0


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


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], tls: _Tls, settings: InjectSettings) -> None:
        super().__init__(address, _Handler)
        self.tls = tls
        self.settings = settings

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        sock.settimeout(IO_TIMEOUT_S)
        tls = self.tls.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return tls, addr

    def finish_request(self, request: Any, client_address: Any) -> None:
        # In the request's own thread: a slow or broken client cannot hold up accept().
        try:
            request.do_handshake()
        except (OSError, ssl.SSLError) as e:
            logger.warning("TLS handshake with %s failed: %s", client_address[0], e)
            return
        super().finish_request(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s", self.address_string(), format % args)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._reply(200, {"ok": True})
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        if self.path != "/mutate":
            self._reply(404, {"error": f"no route {self.path}"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(411, {"error": "Content-Length required"})
            return
        if not 0 < length <= MAX_BODY:
            self._reply(413, {"error": f"body of {length} bytes (at most {MAX_BODY})"})
            return
        try:
            review = json.loads(self.rfile.read(length))
            answer = admission_response(review, self.server.settings)
        except (ValueError, TypeError, AttributeError) as e:
            self._reply(400, {"error": f"bad AdmissionReview: {e}"})
            return
        response = answer["response"]
        logger.info(
            "pod %s/%s: %s",
            review["request"].get("namespace", ""),
            (review["request"].get("object") or {}).get("metadata", {}).get("generateName")
            or review["request"].get("name", ""),
            "patched"
            if "patch" in response
            else ("refused" if not response["allowed"] else "left alone"),
        )
        self._reply(200, answer)


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
    server = WebhookServer((args.host, args.port), tls, settings)
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
