"""Replication pacing benchmark (issue 32): what a push does to a bandwidth-bound TCP stream.

Starts two real daemons on loopback that are each other's peers, and a TCP stream beside them that
sends as fast as it can (standing in for a training job's collective). Measures the stream's
throughput alone, then while a step of ``--size-mb`` is pushed from A to B unpaced, then while the
same push runs with ``TIERCKPT_REPLICATION_MAX_RATE=--rate-mb`` MB/s (a fresh pair of daemons each
time). Reported per run: the push's time and MB/s, and the stream's MB/s during the push.
Loopback shares one machine's CPUs and memory bus, not a NIC: the comparison, not the numbers, is
what carries over (see bench/README.md). ``--smoke`` runs a small size quickly.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from harness import machine_info, write_results

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_client.dcp import TieredStorageWriter
from tierckpt_core.launcher import DaemonProcess, ring

NAMESPACE = "bench-rate"
TOKEN = "bench-replication-rate-token-0123456789"
CHUNK = 1 << 20


class Stream:
    """A loopback TCP stream that sends as fast as it can; ``bytes_between(t0, t1)`` from the
    receiver's per-chunk timestamps."""

    def __init__(self) -> None:
        self._listen = socket.create_server(("127.0.0.1", 0))
        self._stop = threading.Event()
        self._marks: list[tuple[float, int]] = []
        self.errors: list[BaseException] = []
        port = self._listen.getsockname()[1]
        self._rx = threading.Thread(target=self._receive, name="bench-stream-rx", daemon=True)
        self._rx.start()
        self._tx_sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self._tx = threading.Thread(target=self._send, name="bench-stream-tx", daemon=True)
        self._tx.start()

    def _receive(self) -> None:
        try:
            self._listen.settimeout(10)
            conn, _ = self._listen.accept()
            conn.settimeout(10)
            buf = bytearray(CHUNK)
            total = 0
            with conn:
                while not self._stop.is_set():
                    n = conn.recv_into(buf)
                    if not n:
                        return
                    total += n
                    self._marks.append((time.monotonic(), total))
        except BaseException as e:  # seen by the caller (check)
            if not self._stop.is_set():
                self.errors.append(e)

    def _send(self) -> None:
        data = b"\0" * CHUNK
        try:
            while not self._stop.is_set():
                self._tx_sock.sendall(data)
        except OSError as e:
            if not self._stop.is_set():
                self.errors.append(e)

    def mbps(self, t0: float, t1: float) -> float:
        inside = [(t, n) for t, n in list(self._marks) if t0 <= t <= t1]
        if len(inside) < 2:
            return 0.0
        (ta, na), (tb, nb) = inside[0], inside[-1]
        return (nb - na) / max(tb - ta, 1e-9) / 1e6

    def check(self) -> None:
        if self.errors:
            raise RuntimeError(f"the stream died: {self.errors[0]!r}")

    def close(self) -> None:
        self._stop.set()
        self._tx_sock.close()
        self._listen.close()
        self._tx.join(10)
        self._rx.join(10)


def _replicated(a: DaemonProcess, step: int) -> bool:
    with DaemonClient.from_socket(a.socket) as c:
        info = {s.step: s for s in c.steps(NAMESPACE)}.get(step)
    return info is not None and bool(info.replicated_to) and not info.replication_pending


def push(size_mb: int, rate: str | None, stream: Stream, timeout_s: float) -> dict[str, Any]:
    """One step of ``size_mb`` saved on A and pushed to B (``rate``: B's replication cap)."""
    settings = {"replication_max_rate": rate} if rate else {}
    a, b = ring(2, token=TOKEN, prefix="tierckpt-bench-rate", **settings)
    try:
        a.start()
        b.start()
        state = {"w": torch.randn(size_mb << 18, generator=torch.Generator().manual_seed(0))}
        writer = TieredStorageWriter(NAMESPACE, 1, config=ClientConfig.from_env(socket=a.socket))
        dcp.save(state, storage_writer=writer, no_dist=True)
        t0 = time.monotonic()  # the push started at the commit, just before: a slight undercount
        deadline = t0 + timeout_s
        while not _replicated(a, 1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not replicated within {timeout_s:.0f}s")
            time.sleep(0.02)
        t1 = time.monotonic()
        stream.check()
        nbytes = size_mb << 20
        return {
            "rate": rate or "unpaced",
            "push_s": t1 - t0,
            "push_mbps": nbytes / max(t1 - t0, 1e-9) / 1e6,
            "stream_mbps_during_push": stream.mbps(t0, t1),
        }
    finally:
        a.cleanup()
        b.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="the pushed step (MiB)")
    p.add_argument("--rate-mb", type=int, default=200, help="the paced run's cap (MB/s)")
    p.add_argument("--baseline-s", type=float, default=2.0, help="the stream alone (seconds)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="bound on each push")
    p.add_argument("--out", type=Path, default=Path("bench/results/replication_rate.json"))
    p.add_argument("--smoke", action="store_true", help="32 MiB at 64 MB/s, 0.5 s baseline")
    args = p.parse_args()
    if args.smoke:
        args.size_mb, args.rate_mb, args.baseline_s = 32, 64, 0.5
    stream = Stream()
    try:
        t0 = time.monotonic()
        time.sleep(args.baseline_s)
        stream.check()
        res: dict[str, Any] = {"stream_alone_mbps": stream.mbps(t0, time.monotonic())}
        res["unpaced"] = push(args.size_mb, None, stream, args.timeout_s)
        res["paced"] = push(args.size_mb, f"{args.rate_mb}M", stream, args.timeout_s)
    finally:
        stream.close()
    for key in ("unpaced", "paced"):
        r = res[key]
        print(
            f"{key:8s} push {args.size_mb} MiB: {r['push_s']:.2f}s ({r['push_mbps']:.0f} MB/s); "
            f"stream {r['stream_mbps_during_push']:.0f} MB/s (alone {res['stream_alone_mbps']:.0f})"
        )
    write_results(args.out, machine_info(size_mb=args.size_mb, rate_mb=args.rate_mb), res)


if __name__ == "__main__":
    main()
