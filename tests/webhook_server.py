"""The webhook server as the chart's Deployment runs it: its console entry point in a process of its
own, TLS with a self-signed certificate, on 127.0.0.1 (tests/deploy/test_webhook.py)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tierckpt_core.launcher import free_port


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tierckpt-webhook.tierckpt.svc")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("tierckpt-webhook.tierckpt.svc"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "tls.crt", tmp / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@dataclass
class Webhook:
    """A running ``tierckpt-webhook``; ``output()`` stops it and returns its log."""

    proc: subprocess.Popen[bytes]
    port: int
    trust: ssl.SSLContext
    _log: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def client(self, timeout: float = 10) -> httpx.Client:
        return httpx.Client(verify=self.trust, timeout=timeout)

    def threads(self) -> int:
        """The server process's thread count (what its memory grows with, per connection)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
        raise AssertionError("no Threads: line")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def output(self) -> str:
        self.stop()
        return self._log.read_text()


def start_webhook(tmp_path: Path, *args: str) -> Webhook:
    """Start the webhook (extra command-line arguments as given) and wait until it answers."""
    cert, key = _self_signed(tmp_path)
    port = free_port()
    log = tmp_path / f"webhook-{port}.log"
    # The console script's entry point, as the chart's Deployment runs it.
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from tierckpt_webhook.server import main; sys.exit(main())",
                "--host", "127.0.0.1", "--port", str(port),
                "--tls-cert", str(cert), "--tls-key", str(key),
                "--shm-dir", "/dev/shm/tierckpt", "--group", "10001",
                *args,
            ],
            env={**os.environ},
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    hook = Webhook(proc, port, ssl.create_default_context(cafile=str(cert)), log)
    try:
        with hook.client() as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert client.get(f"{hook.url}/healthz").json() == {"ok": True}
                    return hook
                except httpx.TransportError:
                    assert proc.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, "webhook did not start"
                    time.sleep(0.1)
    except BaseException:
        hook.stop()
        raise
