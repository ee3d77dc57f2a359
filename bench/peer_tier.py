"""Peer-tier benchmark: replication to a peer daemon and restore from it after a node loss.

Starts two real daemons, A and B, that list each other as peers (``TIERCKPT_REPLICAS=1``, a shared
token, both on loopback TCP), then measures side by side (see bench/README.md):
(1) replication: a ``dcp.save`` through A returned -> B holds a verified replica, vs. a raw TCP
    transfer of the same bytes over loopback into pre-touched memory (the floor of any peer copy);
(2) restore after A "dies" (stopped, its tmpfs wiped, restarted empty): ``dcp.load`` through A, which
    fetches the step from B and verifies it, vs. the same raw TCP transfer, and vs. a restore from
    A's memory once it is back (the memory tier);
(3) slowdown of a CPU training loop while a step is replicated from A to B.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _peer_report import render, summarize
from _peer_report import rows as rows  # the suite's rows
from harness import (
    MM_SIZE,
    busy_cores,
    check_equal,
    cpu_s,
    free_port,
    machine_info,
    make_state,
    mutate,
    sized_child,
    system_cpu,
    victim,
    write_results,
)

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.launcher import DaemonProcess

NAMESPACE = "bench"
TOKEN = "tierckpt-bench-peer-token-" + uuid.uuid4().hex
POLL_S = 0.01
CHUNK = 8 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="tensor bytes of the state dict (MiB)")
    p.add_argument("--tensors", type=int, default=16, help="float32 tensors in the state dict")
    p.add_argument("--iters", type=int, default=3, help="repetitions per measurement (median)")
    p.add_argument("--loop-s", type=float, default=2.5, help="victim training loop length (s)")
    p.add_argument(
        "--tls",
        action="store_true",
        help="peers talk TLS (a throwaway CA; needs the test extra's cryptography)",
    )
    p.add_argument(
        "--restore-direct",
        choices=["auto", "off"],
        default="auto",
        help="off: the daemon fetches a step from the peer into its memory before the reader "
        "reads it (the path before restores straight into the tensors)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/peer_tier.json"))
    p.add_argument("--smoke", action="store_true", help="32 MiB, 1 iteration, short loop (CI)")
    args = p.parse_args()
    if args.smoke:
        args.size_mb, args.iters, args.loop_s = 32, 1, 0.25
    if args.iters < 1:
        p.error("--iters must be at least 1")
    return args


class Node(DaemonProcess):
    """A daemon with its own tmpfs dir and TCP port, peered with the others (one "node")."""

    def __init__(
        self,
        name: str,
        port: int,
        peers: str,
        capacity_mb: int,
        restore_direct: str = "auto",
        **tls: str,
    ) -> None:
        tag = uuid.uuid4().hex[:8]
        super().__init__(
            Path(f"/dev/shm/tierckpt-bench-peer-{name}-{tag}"),
            log_path=Path(tempfile.gettempdir()) / f"tierckpt-bench-peer-{name}-{tag}.log",
            host="127.0.0.1",
            port=port,
            peers=peers,
            peer_token=TOKEN,
            replicas=1,
            capacity=f"{capacity_mb}M",
            keep_last=2,
            log_level="INFO",
            **tls,
        )
        self.config = ClientConfig.from_env(socket=self.socket, restore_direct=restore_direct)

    def client(self) -> DaemonClient:
        return DaemonClient(self.config)

    def wipe_restart(self) -> None:
        """A replaced node: the daemon and everything in its memory tier are gone."""
        self.lose_node()
        self.start()


def raw_tcp(src: list[memoryview], dst: memoryview) -> float:
    """Send ``src`` over a loopback TCP connection into the pre-touched ``dst``; seconds."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        total = sum(len(s) for s in src)

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
                for s in src:
                    c.sendall(s)

        t0 = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(60)
            off = 0
            while off < total:
                n = conn.recv_into(dst[off : min(off + CHUNK, total)])
                if not n:
                    raise RuntimeError(f"raw TCP transfer ended after {off} of {total} bytes")
                off += n
        dt = time.perf_counter() - t0
        sender.join()
    return dt


class Bench:
    def __init__(self, args: argparse.Namespace, a: Node, b: Node) -> None:
        self.args, self.a, self.b = args, a, b
        self.sd = make_state(args.size_mb, args.tensors)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.sd.values())
        self.step = 0
        self.res: dict[str, Any] = {}

    def _add(self, key: str, seconds: float, **extra: float) -> None:
        r = self.res.setdefault(key, {"s": [], "bytes": self.nbytes})
        r["s"].append(seconds)
        for k, v in extra.items():
            r.setdefault(k, []).append(v)

    def _wait_replicated(self, step: int) -> None:
        deadline = time.monotonic() + 3600
        with self.a.client() as c:
            while True:
                info = c.step(NAMESPACE, step)
                if info.replicated_to and not info.replication_pending:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step {step} not replicated after 1 h")
                time.sleep(POLL_S)

    def save(self) -> int:
        self.step += 1
        mutate(self.sd)
        writer = TieredStorageWriter(NAMESPACE, self.step, config=self.a.config)
        dcp.save(self.sd, storage_writer=writer, no_dist=True)
        return self.step

    def replicate(self) -> int:
        step = self.save()
        c0, w0 = cpu_s(self.a.pid), cpu_s(self.b.pid)
        t0 = time.perf_counter()
        self._wait_replicated(step)
        dt = time.perf_counter() - t0
        self._add(
            "replicate",
            dt,
            cpu_origin=cpu_s(self.a.pid) - c0,
            cpu_receiver=cpu_s(self.b.pid) - w0,
        )
        return step

    def raw(self, dst: memoryview) -> None:
        src = [memoryview(t.numpy()).cast("B") for t in self.sd.values()]
        c0 = cpu_s()
        dt = raw_tcp(src, dst)
        self._add("raw_tcp", dt, cpu_client=cpu_s() - c0)

    def restore_peer(self, step: int, dest: dict[str, torch.Tensor]) -> None:
        self.a.wipe_restart()
        for t in dest.values():
            t.zero_()
        c0, w0, r0 = cpu_s(self.a.pid), cpu_s(self.b.pid), cpu_s()
        t0 = time.perf_counter()
        reader = TieredStorageReader(NAMESPACE, config=self.a.config)  # latest: on the peer
        dcp.load(dest, storage_reader=reader, no_dist=True)
        dt = time.perf_counter() - t0
        cpu = {
            "cpu_daemon": cpu_s(self.a.pid) - c0,
            "cpu_peer": cpu_s(self.b.pid) - w0,
            "cpu_reader": cpu_s() - r0,
        }
        if reader.resolved_step != step:
            raise AssertionError(f"restored step {reader.resolved_step}, expected {step}")
        check_equal(dest, self.sd, f"step {step} restored from the peer")
        self._add("restore_peer", dt, **cpu)
        # Read straight from B into the tensors, A then brings the step into its memory in the
        # background (the next restore is local): timed to its end, not part of the restore.
        if reader.memory_fill is not None:
            reader.memory_fill.join()
            self._add("fill_memory", time.perf_counter() - t0 - dt)
        for t in dest.values():  # the step is in A's memory now: the memory tier, for reference
            t.zero_()
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=TieredStorageReader(NAMESPACE, step, config=self.a.config))
        self._add("restore_memory", time.perf_counter() - t0)
        check_equal(dest, self.sd, f"step {step} from memory")

    def slowdown(self, steps: int) -> None:
        a, b = torch.randn(MM_SIZE, MM_SIZE), torch.randn(MM_SIZE, MM_SIZE)
        for _ in range(self.args.iters):
            s0 = system_cpu()
            t0 = time.perf_counter()
            victim(a, b, steps)
            alone = time.perf_counter() - t0
            s1 = system_cpu()
            step = self.save()
            s2 = system_cpu()
            t0 = time.perf_counter()
            victim(a, b, steps)
            busy = time.perf_counter() - t0
            s3 = system_cpu()
            with self.a.client() as c:
                covered = bool(c.step(NAMESPACE, step).replication_pending)
            self._wait_replicated(step)
            r = self.res.setdefault("slowdown", {"steps": steps})
            for k, v in (
                ("alone_s", alone),
                ("busy_s", busy),
                ("covered", covered),
                ("system_busy_alone", busy_cores(s0, s1)),
                ("system_busy", busy_cores(s2, s3)),
            ):
                r.setdefault(k, []).append(v)

    def run(self) -> dict[str, Any]:
        dst = torch.ones(self.nbytes, dtype=torch.uint8)  # pre-touched
        step = 0
        for it in range(self.args.iters):  # alternate which one goes first
            if it % 2:
                self.raw(memoryview(dst.numpy()).cast("B"))
            step = self.replicate()
            if not it % 2:
                self.raw(memoryview(dst.numpy()).cast("B"))
        dst.resize_(0)  # give the memory back
        dest = {k: torch.zeros_like(v) for k, v in self.sd.items()}
        for _ in range(self.args.iters):
            self.restore_peer(step, dest)
            # A is back: new steps replicate from here; restore the newest again next time
            step = self.replicate()
        a, b = torch.randn(MM_SIZE, MM_SIZE), torch.randn(MM_SIZE, MM_SIZE)
        victim(a, b, 10)
        t0 = time.perf_counter()
        victim(a, b, 40)
        steps = max(10, int(self.args.loop_s / ((time.perf_counter() - t0) / 40)))
        self.slowdown(steps)
        return self.res


WHAT = "peer tier (two daemons, replication)"


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """The suite's run: at ``--peer-size-mb`` (this script's default if unset)."""
    return sized_child("peer_tier.py", WHAT, args, "no_peer", "peer_size_mb", tmp, notes)


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    info = machine_info(
        size_mb=args.size_mb,
        tensors=args.tensors,
        iters=args.iters,
        tls=args.tls,
        restore_direct=args.restore_direct,
    )
    print(
        f"machine: {info['cores']} cores, {info['mem_gib']} GiB, torch {info['torch']}, python "
        f"{info['python']}; {args.size_mb} MiB in {args.tensors} tensors x {args.iters} iters"
        f"{'; peers over TLS' if args.tls else ''}"
        f"{'; the daemon fetches restores first' if args.restore_direct == 'off' else ''}"
    )
    ports = [free_port(), free_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    capacity = 4 * args.size_mb + 1024  # own steps (keep_last 2 + 1) and the peer's replicas
    tls: dict[str, str] = {}
    if args.tls:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from certs import CA, tls_settings  # test helper: a throwaway CA

        tmp = Path(tempfile.mkdtemp(prefix="tierckpt-bench-tls-"))
        ca = CA.make(tmp, "bench-ca")
        tls = tls_settings(ca, ca.issue(tmp, "node", dns=[], ips=["127.0.0.1"]))
    a, b = (
        Node(n, p, peers, capacity, args.restore_direct, **tls)
        for n, p in zip("ab", ports, strict=True)
    )
    try:
        a.start()
        b.start()
        res = Bench(args, a, b).run()
    except BaseException:
        for n in (a, b):
            print(f"daemon {n.name} log (tail):\n{n.log()}", file=sys.stderr)
        raise
    finally:
        a.cleanup()
        b.cleanup()
    summarize(res)
    print(render(res))
    write_results(args.out, info, res)


if __name__ == "__main__":
    main()
