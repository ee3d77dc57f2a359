"""Test helpers: a real daemon in a subprocess on a real Unix socket, and spawned gloo ranks."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierckpt_client import DaemonClient, DaemonUnavailableError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DaemonProcess:
    """``python -m tierckpt_daemon`` with its own tmpfs directory; start, kill, restart."""

    def __init__(self, shm_dir: Path, **settings: Any) -> None:
        self.shm_dir = shm_dir
        self.socket = shm_dir / "daemon.sock"
        self.settings = {"capacity": "2G", "port": 0, **settings}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = shm_dir.parent / f"{shm_dir.name}.log"

    @property
    def env(self) -> dict[str, str]:
        return {"TIERCKPT_SOCKET": str(self.socket)}

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        env = dict(os.environ)
        # A test's client-side settings must not leak into the daemon (its socket would move).
        for name in ("TIERCKPT_SOCKET", "TIERCKPT_PERSIST_URL"):
            env.pop(name, None)
        env["TIERCKPT_SHM_DIR"] = str(self.shm_dir)
        for k, v in self.settings.items():
            env[f"TIERCKPT_{k.upper()}"] = str(v)
        log = open(self.log_path, "ab")  # noqa: SIM115 (lives as long as the process)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierckpt_daemon"], env=env, stdout=log, stderr=log
        )
        log.close()
        deadline = time.monotonic() + timeout
        client = DaemonClient.from_socket(self.socket, connect_timeout_s=2.0, timeout_s=10.0)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
                with contextlib.suppress(DaemonUnavailableError):
                    client.status()
                    return self
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon did not become ready:\n{self.log()}")
                time.sleep(0.05)
        finally:
            client.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self.proc = None

    def restart(self) -> DaemonProcess:
        self.kill()
        return self.start()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.log_path.unlink()


def new_shm_dir() -> Path:
    return Path("/dev/shm") / f"tierckpt-test-{uuid.uuid4().hex[:10]}"


def _rank_entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...]
) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes on one gloo group."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
