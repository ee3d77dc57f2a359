"""Daemons as subprocesses, for the demo, the tests and the benchmarks: one per "node", and several
of them as several nodes on one machine.

:class:`DaemonProcess` runs ``python -m tierckpt_daemon`` on its own tmpfs directory, configured by
``TIERCKPT_*`` settings given as keyword arguments (``persist_url="file:///..."`` sets
``TIERCKPT_PERSIST_URL``), and waits until it answers on its socket. :func:`ring` makes ``n`` of
them peers of each other: each gets its own TCP port and node name (``127.0.0.1:<port>``), all list
the others in ``TIERCKPT_PEERS`` and share one peer token. A training rank is put on a node by
giving it that node's :attr:`DaemonProcess.client_env` (``TIERCKPT_SOCKET``).

A dev and test tool, not part of a deployment. It lives in the core so that the demo
(:mod:`tierckpt_client.demo`), the tests and the benchmarks share it while the client still never
imports the daemon package: a daemon is started as a process, by module name. Standard library
only; readiness is one ``GET /v1/status`` over the socket.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Settings a caller's environment may hold for its own clients; they must not leak into a daemon.
_CLIENT_SIDE = ("TIERCKPT_SOCKET", "TIERCKPT_PERSIST_URL", "TIERCKPT_NODE_NAME")


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the same range as the source ports of
    outgoing connections: between this call and the daemon's ``bind``, any connection made on
    the machine (a client to another daemon, gloo's) could take it, and the daemon then failed
    with "Address already in use" (seen once in CI). A port below that range is never picked
    for an outgoing connection; only an explicit ``bind`` can take it."""
    lo = _ephemeral_start()
    for _ in range(64):
        port = random.randrange(max(1024, lo - 12000), lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or lingering): another
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(2048, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


def new_shm_dir(prefix: str = "tierckpt") -> Path:
    """A fresh (not yet created) directory on /dev/shm for a daemon's memory tier."""
    return Path("/dev/shm") / f"{prefix}-{uuid.uuid4().hex[:10]}"


class DaemonProcess:
    """One daemon: start, stop (SIGTERM: uploads drain), kill, restart, lose its node's memory."""

    def __init__(
        self,
        shm_dir: Path,
        *,
        log_path: Path | None = None,
        extra_env: Mapping[str, str] | None = None,
        wrap: Sequence[str] = (),
        **settings: Any,
    ) -> None:
        self.shm_dir = shm_dir
        # A command prefix that execs the daemon, e.g. ``ip netns exec <ns>`` (the network tests
        # run each node's daemon in its own network namespace); the pid stays the daemon's.
        self.wrap = list(wrap)
        self.socket = shm_dir / "daemon.sock"
        self.settings: dict[str, Any] = {"capacity": "2G", "port": 0, **settings}
        self.extra_env = dict(extra_env or {})
        self.log_path = log_path or shm_dir.parent / f"{shm_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str | None:
        """This daemon's node name on a ring (``127.0.0.1:<port>``), if it has a port."""
        port = int(self.settings.get("port") or 0)
        return str(self.settings.get("node_name") or f"127.0.0.1:{port}") if port else None

    @property
    def client_env(self) -> dict[str, str]:
        """What a trainer on this node sets to reach this daemon."""
        return {"TIERCKPT_SOCKET": str(self.socket)}

    env = client_env  # the name the tests have always used

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"the daemon on {self.shm_dir} is not running")
        return self.proc.pid

    def start(
        self, timeout: float = 60.0, *, ready: Callable[[dict[str, Any]], bool] | None = None
    ) -> DaemonProcess:
        """Start the daemon and wait until it answers (and ``ready(status)`` holds, if given)."""
        env = {k: v for k, v in os.environ.items() if k not in _CLIENT_SIDE}
        env.update(self.extra_env)
        env["TIERCKPT_SHM_DIR"] = str(self.shm_dir)
        for k, v in self.settings.items():
            env[f"TIERCKPT_{k.upper()}"] = str(v)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.wrap, sys.executable, "-m", "tierckpt_daemon"],
                env=env,
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"daemon exited with {code}:\n{self.log()}")
            status = self.status()
            if status is not None and (ready is None or ready(status)):
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"daemon did not become ready:\n{self.log()}")
            time.sleep(0.05)

    def status(self) -> dict[str, Any] | None:
        """The daemon's ``/v1/status``, or None if it does not answer."""
        if not self.socket.exists():
            return None
        conn = _UnixHTTPConnection(str(self.socket), timeout=5.0)
        try:
            conn.request("GET", "/v1/status")
            resp = conn.getresponse()
            body = resp.read()
        except OSError:
            return None
        finally:
            conn.close()
        if resp.status != 200:
            return None
        doc: dict[str, Any] = json.loads(body)
        return doc

    def log(self) -> str:
        """The tail of the daemon's log."""
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 120.0) -> None:
        """SIGTERM (queued uploads drain first), then wait; SIGKILL if it does not exit."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.proc = None

    def restart(self) -> DaemonProcess:
        self.kill()
        return self.start()

    def lose_node(self) -> None:
        """The node is gone: the daemon is killed and its memory tier wiped (not restarted)."""
        self.kill()
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.log_path.unlink()


def ring(
    n: int,
    *,
    token: str,
    replicas: int = 1,
    prefix: str = "tierckpt-node",
    per_node: list[dict[str, Any]] | None = None,
    **settings: Any,
) -> list[DaemonProcess]:
    """``n`` daemons (not started) that are each other's peers, as ``n`` nodes on this machine;
    ``per_node[i]`` overrides settings (``replicas`` included) of the i-th."""
    ports = [free_port() for _ in range(n)]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    extra = per_node or [{} for _ in range(n)]
    return [
        DaemonProcess(
            new_shm_dir(prefix),
            port=port,
            host="127.0.0.1",
            node_name=f"127.0.0.1:{port}",
            peers=peers,
            peer_token=token,
            **{"replicas": replicas, **settings, **more},
        )
        for port, more in zip(ports, extra, strict=True)
    ]
