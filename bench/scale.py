"""Scale harness: N daemons on one machine as N nodes of one ring, M ranks per node, driven
through the daemon API as TieredStorageWriter drives it (issue 22).

Per save, each rank leases a file on its own node's daemon, writes it, checksums it and seals it
under the save's attempt id (``POST .../leases``, ``POST .../attempts/<a>/seal``); then the
coordinator (rank 0, node 0: the decider) commits the step on every node
(``POST .../attempts/<a>/commit`` with every file, the node that holds it and the job's DCP
metadata, encoded with the client's own codec). The metadata is shaped like an FSDP job's: every
tensor sharded on dim 0 over every rank.

For each N it reports time to committed (the commit call; median and max), the save's lease+seal
phase, each daemon's I/O bytes (``/proc/<pid>/io`` rchar+wchar: its sockets, local and peer, and
the record files it writes) and CPU-seconds (utime+stime) during the commit, the commit-record
bytes a node keeps per step (the ``.json`` files of the step in its tier), daemon RSS, the latency
of ``candidates`` (what a reader asks to find "latest" and its holders), and the restore of a
replaced node: node 1 is killed, restarted with an empty tier, and its share is brought
back from the peer that holds its replica (``candidates``, ``hydrate``, ``pin``).

Only node 1 replicates (``replicas=1``, to node 2, its successor): the byte and CPU figures of
the participants (nodes 3 and up; at N = 2 node 1) are then the commit's alone, not a replica
push landing in the same window.

    python bench/scale.py --nodes 2,4,8,16 --out bench/results/scale.json
    python bench/scale.py --nodes 8,16,32,64 --ranks 1 --tensors 8 --file-kib 16 --tag small
    python bench/scale.py --small   # CI: N = 2, 4, tiny files, < 60 s

Torch is imported only to build the synthetic DCP metadata (``--tensors``) with the client's
codec, the one the writer ships in the commit request.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt_client import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.integrity import block_digest, checksum_blocks
from tierckpt_core.launcher import DaemonProcess, ring
from tierckpt_core.metadata_blob import pack_metadata
from tierckpt_core.protocol import CommitRequest, SealFile

TOKEN = "bench-scale-peer-token-not-a-secret-0123"
NS = "bench-scale"
SEGMENT_MAX = 64 << 10  # the writer's segment threshold (tierckpt_client.dcp._items)
CLK_TCK = os.sysconf("SC_CLK_TCK")
VICTIM = 1  # the node that is replaced; the only one that replicates (to node 2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="2,4,8,16", help="comma-separated ring sizes")
    p.add_argument("--ranks", type=int, default=4, help="ranks per node")
    p.add_argument("--file-kib", type=int, default=16 << 10, help="file per rank, KiB")
    p.add_argument("--tensors", type=int, default=200, help="tensors, each sharded over all ranks")
    p.add_argument("--commits", type=int, default=5, help="saves per N (the first is warm-up)")
    p.add_argument("--candidates", type=int, default=5, help="candidates calls timed per node")
    p.add_argument("--no-restore", action="store_true", help="skip the replaced node's restore")
    p.add_argument(
        "--json-metadata",
        action="store_true",
        help="send the metadata as a JSON object (writers before 075a2e0), not compressed text",
    )
    p.add_argument("--tag", default="", help="label of this run in the table")
    p.add_argument("--out", type=Path, default=Path("bench/results/scale.json"))
    p.add_argument("--md", type=Path, default=None, help="also write the table here")
    p.add_argument("--plot", type=Path, default=None, help="PNG (or SVG) of latency and bytes")
    p.add_argument(
        "--replot", type=Path, nargs="+", help="only plot these JSON results together (--plot)"
    )
    p.add_argument("--labels", default="", help="';'-separated labels of the --replot runs")
    p.add_argument("--small", action="store_true", help="CI: N = 2, 4; 16 KiB files; 3 saves")
    args = p.parse_args()
    if args.small:
        args.nodes, args.file_kib, args.commits, args.candidates = "2,4", 16, 3, 3
        args.tensors = min(args.tensors, 20)
    args.node_counts = [int(x) for x in args.nodes.split(",") if x.strip()]
    if any(n < 2 for n in args.node_counts):
        p.error("--nodes: a ring has at least 2 nodes")
    if args.commits < 2:
        p.error("--commits must be at least 2 (the first is warm-up)")
    return args


# -- the job's DCP metadata ---------------------------------------------------------------------
_NAMES = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3", "norm")


def fsdp_metadata(world: int, tensors: int, file_bytes: int) -> tuple[dict[str, Any], int]:
    """The encoded DCP metadata of ``tensors`` bf16 tensors, each sharded on dim 0 over
    ``world`` ranks (FSDP2), rank r's chunks laid out one after another in ``r<r>.data``; and
    the length of one chunk (the segments of a small chunk are checksummed like the writer's)."""
    from tierckpt_client.dcp._metadata_codec import encode_metadata

    md, chunk = fsdp_metadata_object(world, tensors, file_bytes)
    return encode_metadata(md), chunk


def fsdp_metadata_object(world: int, tensors: int, file_bytes: int) -> tuple[Any, int]:
    """:func:`fsdp_metadata` as DCP's ``Metadata``, before the client encodes it."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from tierckpt_client.dcp._metadata_codec import ShardRef

    cols = 128
    rows = max(1, file_bytes // tensors // (2 * cols))
    chunk = rows * cols * 2
    sd: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner: dict[str, tuple[str, ...]] = {}
    for t in range(tensors):
        fqn = f"model.layers.{t // len(_NAMES)}.{_NAMES[t % len(_NAMES)]}.weight"
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size([r * rows, 0]), sizes=torch.Size([rows, cols]))
            for r in range(world)
        ]
        sd[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.bfloat16),
            size=torch.Size([world * rows, cols]),
            chunks=chunks,
        )
        planner[fqn] = tuple(fqn.split("."))
        for r in range(world):
            idx = MetadataIndex(fqn=fqn, offset=torch.Size([r * rows, 0]), index=0)
            storage[idx] = ShardRef(
                file=f"r{r:05d}.data",
                offset=t * chunk,
                length=chunk,
                dtype="bfloat16",
                shape=(rows, cols),
            )
    return Metadata(state_dict_metadata=sd, planner_data=planner, storage_data=storage), chunk


# -- one daemon's counters ------------------------------------------------------------------
NETCOUNT = Path(__file__).resolve().parent / "netcount"  # its sitecustomize counts socket bytes


@dataclass
class Sample:
    net: dict[str, float]  # bytes on the daemon's sockets (see netcount/sitecustomize.py)
    cpu: float  # utime + stime, seconds


def sample(pid: int, netdir: Path) -> Sample:
    try:
        net = json.loads((netdir / f"{pid}.json").read_text())
    except FileNotFoundError:
        net = {}
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)
    return Sample(net, cpu)


def snapshot(pids: list[int], netdir: Path, timeout: float = 10.0) -> list[Sample]:
    """Every daemon's counters as of now: each counter file written after this call began (a
    daemon's writer thread can be late under load; a stale file would miss bytes)."""
    asked = time.time()
    deadline = time.monotonic() + timeout
    while True:
        got = [sample(p, netdir) for p in pids]
        if all(s.net.get("t", 0) >= asked for s in got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def net_delta(a: Sample, b: Sample, key: str) -> int:
    return int(a.net.get(key, 0) - b.net.get(key, 0))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def record_bytes(d: DaemonProcess, step: int) -> int:
    """Bytes of the commit records (``*.json``) this node keeps for ``step``: any file under its
    tier whose path names the step's directory and is not a data file."""
    total = 0
    marker = f"{step:012d}"
    for root, _, names in os.walk(d.shm_dir):
        if marker not in root:
            continue
        for n in names:
            if n.endswith(".json"):
                with contextlib.suppress(FileNotFoundError):
                    total += (Path(root) / n).stat().st_size
    return total


# -- one ring ---------------------------------------------------------------------------------
@dataclass
class RankFile:
    data: bytes
    checksum: str
    block_size: int
    blocks: list[str]
    segments: list[tuple[int, int, str]] | None


@dataclass
class Ring:
    nodes: list[DaemonProcess]
    ranks: int
    netdir: Path
    clients: list[DaemonClient] = field(default_factory=list)

    def client(self, rank: int) -> DaemonClient:
        return self.clients[rank // self.ranks]


def rank_file(rank: int, size: int, chunk: int, tensors: int) -> RankFile:
    data = (rank.to_bytes(4, "little") + b"tierckpt-scale-bench" * 3)[:64] * (size // 64 + 1)
    data = data[:size]
    whole, bsize, blocks = checksum_blocks(memoryview(data))
    segments = None
    if chunk <= SEGMENT_MAX:  # the writer checksums small items on their own (a save across nodes)
        segments = [
            (t * chunk, chunk, block_digest(data[t * chunk : (t + 1) * chunk]))
            for t in range(tensors)
            if (t + 1) * chunk <= size
        ]
    return RankFile(data, whole, bsize, blocks, segments)


def save_rank(r: Ring, rank: int, step: int, attempt: str, f: RankFile) -> float:
    """One rank's part of a save, as MemoryTier does it: lease, write, seal (checksums sent)."""
    c = r.client(rank)
    t0 = time.perf_counter()
    lease = c.lease(NS, rank, len(f.data))
    fd = os.open(lease.path, os.O_WRONLY)
    try:
        os.pwrite(fd, f.data, 0)
    finally:
        os.close(fd)
    seal = SealFile(
        lease_id=lease.lease_id,
        name=f"r{rank:05d}.data",
        length=len(f.data),
        segments=f.segments,
        checksum=f.checksum,
        block_size=f.block_size,
        blocks=f.blocks,
    )
    c.seal(NS, step, attempt, rank, [seal])
    return time.perf_counter() - t0


def start_ring(n: int, ranks: int, file_bytes: int, tag: str) -> Ring:
    per_step = ranks * file_bytes
    netdir = Path(tempfile.mkdtemp(prefix=f"tierckpt-bench-scale-net-{tag}-"))
    path = os.pathsep.join(x for x in (str(NETCOUNT), os.environ.get("PYTHONPATH")) if x)
    env = {"PYTHONPATH": path, "TIERCKPT_BENCH_NETCOUNT": str(netdir)}
    capacity = per_step * 4 + 2 * file_bytes * ranks + (64 << 20)  # keep_last 2, a replica, slack
    nodes = ring(
        n,
        token=TOKEN,
        replicas=0,
        prefix=f"tierckpt-bench-scale-{tag}",
        capacity=str(capacity),
        keep_last=2,
        log_level="WARNING",
        background_nice=0,
    )
    # Ring order is the order of the names: index i is then the i-th node of the ring, node 0 the
    # decider, node 1 the one that is replaced (the only one that replicates: to node 2).
    nodes.sort(key=lambda d: str(d.name))
    nodes[VICTIM % n].settings["replicas"] = 1
    for d in nodes:
        d.extra_env.update(env)
    r = Ring(nodes, ranks, netdir)
    try:
        with concurrent.futures.ThreadPoolExecutor(min(16, n)) as pool:
            list(pool.map(lambda d: d.start(timeout=300), nodes))
    except BaseException:
        stop_ring(r)
        raise
    fresh_clients(r)
    return r


def fresh_clients(r: Ring) -> None:
    """New connections to every daemon: a pooled one left idle past uvicorn's keep-alive (5 s,
    easily passed while a big commit runs) can be reset just as it is reused."""
    for c in r.clients:
        c.close()
    r.clients = [
        DaemonClient(ClientConfig.from_env(socket=str(d.socket), timeout_s=300)) for d in r.nodes
    ]


def stop_ring(r: Ring) -> None:
    for c in r.clients:
        c.close()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda d: d.cleanup(), r.nodes))
    shutil.rmtree(r.netdir, ignore_errors=True)


def wait(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def run_n(args: argparse.Namespace, n: int, meta_cache: dict[Any, Any]) -> dict[str, Any]:
    m, file_bytes = args.ranks, args.file_kib << 10
    world = n * m
    key = (world, args.tensors, file_bytes)
    if key not in meta_cache:
        t0 = time.perf_counter()
        meta_cache[key] = (*fsdp_metadata(world, args.tensors, file_bytes), 0.0)
        meta_cache[key] = (*meta_cache[key][:2], time.perf_counter() - t0)
    metadata, chunk, _ = meta_cache[key]
    meta_bytes = len(json.dumps(metadata, separators=(",", ":")))
    # As the writer sends it (compressed text the daemons keep opaque), or --json-metadata: the
    # JSON object, as writers before 075a2e0 sent it.
    sent: str | dict[str, Any] = metadata if args.json_metadata else pack_metadata(metadata)
    sent_bytes = len(sent) if isinstance(sent, str) else meta_bytes
    files = [rank_file(rank, file_bytes, chunk, args.tensors) for rank in range(world)]
    tag = uuid.uuid4().hex[:6]
    t_start = time.perf_counter()
    for tries in range(3):  # ports are picked free, then bound: another process can win one
        try:
            r = start_ring(n, m, file_bytes, f"{tag}{tries}")
            break
        except RuntimeError as e:
            if "Address already in use" not in str(e) or tries == 2:
                raise
            print(f"N={n}: a port was taken before its daemon bound it; new ports", flush=True)
    startup_s = time.perf_counter() - t_start
    try:
        names = [str(d.name) for d in r.nodes]
        pids = [d.pid for d in r.nodes]
        base = uuid.uuid4().hex[:16]
        commits: list[dict[str, Any]] = []
        with concurrent.futures.ThreadPoolExecutor(min(32, world)) as pool:
            for step in range(1, args.commits + 1):
                attempt = f"{base}.1"
                fresh_clients(r)
                before_save = snapshot(pids, r.netdir)
                t0 = time.perf_counter()
                seals = list(
                    pool.map(
                        lambda rank, s=step, a=attempt: save_rank(r, rank, s, a, files[rank]),
                        range(world),
                    )
                )
                sealed_s = time.perf_counter() - t0
                req = CommitRequest(
                    files=sorted(f"r{rank:05d}.data" for rank in range(world)),
                    metadata=sent,
                    world_size=world,
                    nodes={f"r{rank:05d}.data": names[rank // m] for rank in range(world)},
                )
                before = snapshot(pids, r.netdir)
                t1 = time.perf_counter()
                info = r.clients[0].commit(NS, step, attempt, req)
                commit_s = time.perf_counter() - t1
                after = snapshot(pids, r.netdir)
                if info.state.value not in ("committed", "replicated", "durable"):
                    raise RuntimeError(f"step {step} committed as {info.state}")
                commits.append(
                    {
                        "step": step,
                        "seal_phase_s": sealed_s,
                        "rank_seal_s_max": max(seals),
                        "commit_s": commit_s,
                        **{
                            k: [net_delta(a, b, k) for a, b in zip(after, before, strict=True)]
                            for k in ("tcp_sent", "tcp_recv", "unix_sent", "unix_recv", "sendfile")
                        },
                        "cpu_s": [a.cpu - b.cpu for a, b in zip(after, before, strict=True)],
                        "save_cpu_s": [
                            a.cpu - b.cpu for a, b in zip(after, before_save, strict=True)
                        ],
                    }
                )
                # Node 1's replica push must not land in the next commit's window.
                wait(
                    f"step {step} replicated from node {VICTIM}",
                    lambda: (
                        not ((r.nodes[VICTIM].status() or {}).get("replication") or {}).get(
                            "queued_steps"
                        )
                    ),
                    300,
                )
        last = args.commits
        fresh_clients(r)
        # Every node shows the step committed (a participant commits on the decision).
        for c in r.clients:
            wait(f"step {last} on every node", lambda c=c: c.step(NS, last).state, 120)
        records = [record_bytes(d, last) for d in r.nodes]
        rss = [rss_mb(p) for p in pids]
        cand: dict[str, list[float]] = {"decider": [], "participant": []}
        for label, c in (("decider", r.clients[0]), ("participant", r.clients[n // 2])):
            for _ in range(args.candidates):
                t0 = time.perf_counter()
                c.candidates(NS)
                cand[label].append(time.perf_counter() - t0)
        restore = None if args.no_restore else replace_last_node(r, last, m, file_bytes)
    except BaseException:
        for d in r.nodes[:3]:
            print(f"daemon {d.name} log (tail):\n{d.log()}", file=sys.stderr)
        raise
    finally:
        stop_ring(r)
    return summarize(
        args, n, commits, records, rss, cand, restore, (meta_bytes, sent_bytes), startup_s
    )


def replace_last_node(r: Ring, step: int, m: int, file_bytes: int) -> dict[str, Any]:
    """Node 1 is lost (killed, memory wiped) and a new daemon takes its place with an
    empty tier; time until its share of ``step`` is in its memory again, brought from the peer
    holding its replica, as a reader's daemon brings it (candidates, hydrate, pin)."""
    victim, c = r.nodes[VICTIM], r.clients[VICTIM]
    share = {f"r{rank:05d}.data" for rank in range(VICTIM * m, (VICTIM + 1) * m)}
    wait(
        "the replaced node's share replicated",
        lambda: (
            (victim.status() or {}).get("replication", {}).get("queued_steps") == 0
            and c.step(NS, step).replicated_to
        ),
        300,
    )
    victim.lose_node()
    t0 = time.perf_counter()
    victim.start(timeout=300)
    started = time.perf_counter() - t0
    c.close()
    t0 = time.perf_counter()
    cands = c.candidates(NS)
    if not cands or cands[0].step != step:
        raise RuntimeError(f"the replaced node's latest is {cands[:1]}, not step {step}")
    c.hydrate(NS, step, sorted(share))
    pin = c.pin(NS, step)
    restore_s = time.perf_counter() - t0
    missing = share - set(pin.paths)
    c.unpin(NS, step, pin.pin_id)
    if missing:
        raise RuntimeError(f"after hydrate the replaced node lacks {sorted(missing)}")
    return {
        "start_s": started,
        "restore_s": restore_s,
        "bytes": len(share) * file_bytes,
        "MBps": len(share) * file_bytes / restore_s / 1e6,
    }


def summarize(
    args: argparse.Namespace,
    n: int,
    commits: list[dict[str, Any]],
    records: list[int],
    rss: list[float],
    cand: dict[str, list[float]],
    restore: dict[str, Any] | None,
    meta_sizes: tuple[int, int],
    startup_s: float,
) -> dict[str, Any]:
    steady = commits[1:]  # the first save faults in fresh tmpfs pages and warms connections
    lat = [c["commit_s"] for c in steady]
    # Participants: every node but the decider (0),
    # the replaced node and its replica's target (its replica push may overlap the window); at
    # N = 2 the only participant is the replaced node, and its push lands on the decider.
    others = range(3, n) if n > 3 else range(1, n)

    def per(key: str, node_set: Any) -> float:
        return statistics.median(c[key][i] for c in steady for i in node_set)

    return {
        "nodes": n,
        "ranks_per_node": args.ranks,
        "file_bytes": args.file_kib << 10,
        "tensors": args.tensors,
        "metadata_json_bytes": meta_sizes[0],
        "metadata_sent_bytes": meta_sizes[1],
        "ring_start_s": startup_s,
        "commit_s": {"median": statistics.median(lat), "max": max(lat), "all": lat},
        "seal_phase_s": statistics.median(c["seal_phase_s"] for c in steady),
        # Bytes on the daemons' TCP sockets (the peer protocol) during the commit call.
        "peer_bytes_per_commit": {
            "decider_sent": per("tcp_sent", [0]),
            "decider_recv": per("tcp_recv", [0]),
            "participant_sent": per("tcp_sent", others),
            "participant_recv": per("tcp_recv", others),
            "participant_recv_max": max(c["tcp_recv"][i] for c in steady for i in others),
            "all_nodes_sum": statistics.median(sum(c["tcp_sent"]) for c in steady),
        },
        # The commit request itself, trainer -> decider's daemon over the Unix socket.
        "decider_local_recv": per("unix_recv", [0]),
        "cpu_s_per_commit": {
            "decider": per("cpu_s", [0]),
            "participant_median": per("cpu_s", others),
            "all_nodes_sum": statistics.median(sum(c["cpu_s"]) for c in steady),
            "save_all_nodes_sum": statistics.median(sum(c["save_cpu_s"]) for c in steady),
        },
        "record_bytes_per_step": {
            "decider": records[0],
            "participant_median": statistics.median(records[i] for i in others),
            "max": max(records),
        },
        "rss_mb": {"median": statistics.median(rss), "max": max(rss)},
        "candidates_s": {k: statistics.median(v) for k, v in cand.items()},
        "restore": restore,
        "raw_commits": commits,
    }


# -- output -------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]], tag: str) -> str:
    head = (
        "| nodes | ranks | file | metadata JSON (sent) | committed median (max) | lease+seal | "
        "peer bytes/commit: decider sent (recv) | participant recv (sent) | CPU s/commit decider / participant | "
        "records kept/step participant (decider) | RSS median (max) | candidates | "
        "replaced node: restore (start) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        pb, cpu = r["peer_bytes_per_commit"], r["cpu_s_per_commit"]
        rec = r["record_bytes_per_step"]
        rs = r["restore"]
        restore = (
            f"{rs['restore_s']:.2f} s, {_size(rs['bytes'])} ({rs['start_s']:.1f} s)" if rs else "-"
        )
        lines.append(
            f"| {r['nodes']} | {r['ranks_per_node']} | {_size(r['file_bytes'])} | "
            f"{_size(r['metadata_json_bytes'])} ({_size(r.get('metadata_sent_bytes', 0))}) | "
            f"{r['commit_s']['median']:.3f} s "
            f"({r['commit_s']['max']:.3f}) | {r['seal_phase_s']:.2f} s | "
            f"{_size(pb['decider_sent'])} ({_size(pb['decider_recv'])}) | "
            f"{_size(pb['participant_recv'])} ({_size(pb['participant_sent'])}) | "
            f"{cpu['decider']:.2f} / {cpu['participant_median']:.2f} | "
            f"{_size(rec['participant_median'])} ({_size(rec['decider'])}) | "
            f"{r['rss_mb']['median']:.0f} MB ({r['rss_mb']['max']:.0f}) | "
            f"{r['candidates_s']['participant'] * 1e3:.0f} ms | {restore} |"
        )
    title = f"**{tag}**\n\n" if tag else ""
    return title + head + "\n".join(lines) + "\n"


def _size(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= scale:
            return f"{b / scale:.{2 if b < 10 * scale else 1}f} {unit}"
    return f"{b:.0f} B"


Series = tuple[str, list[dict[str, Any]]]  # a run's label and its rows


def _curves(rows: list[dict[str, Any]]) -> tuple[list[int], list[float], list[float], list[float]]:
    pb = [r["peer_bytes_per_commit"] for r in rows]
    return (
        [r["nodes"] for r in rows],
        [r["commit_s"]["median"] for r in rows],
        [(b["decider_sent"] + b["decider_recv"]) / 1e6 for b in pb],
        [(b["participant_sent"] + b["participant_recv"]) / 1e6 for b in pb],
    )


def plot(series: list[Series], path: Path) -> None:
    """Commit latency and peer bytes per node per commit against N, one line per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        path = path.with_suffix(".svg")
        path.write_text(_svg(series))
        print(f"plot written to {path}")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5 + 0.15 * len(series)))
    ticks: set[int] = set()
    for i, (label, rows) in enumerate(series):
        xs, lat, dec, par = _curves(rows)
        ticks.update(xs)
        color = f"C{i}"
        a.plot(xs, lat, "o-", color=color, label=label)
        b.plot(xs, dec, "o-", color=color, label=f"{label}: decider")
        b.plot(xs, par, "s--", color=color, label=f"{label}: participant")
    a.set(xscale="log", yscale="log", xlabel="nodes", ylabel="time to committed, s (median)")
    a.set_title("commit latency")
    b.set(xscale="log", yscale="log", xlabel="nodes", ylabel="MB sent + received per commit")
    b.set_title("peer bytes per node per commit")
    for ax in (a, b):
        ax.set_xticks(sorted(ticks), [str(x) for x in sorted(ticks)])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=7, loc="upper left", title="run (what it measured, commit)")
    # Circles: the decider; squares, dashed: the median participant.
    b.legend(
        fontsize=6,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.15),
        ncol=2,
        title="circles: the decider; squares, dashed: the median participant",
        title_fontsize=6,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")


def _svg(series: list[Series]) -> str:
    """A bare two-panel SVG (no matplotlib): linear axes, one polyline per curve."""
    xs = sorted({r["nodes"] for _, rows in series for r in rows})
    panels: list[list[tuple[str, list[tuple[int, float]]]]] = [[], []]
    for label, rows in series:
        n, lat, dec, par = _curves(rows)
        panels[0].append((label, list(zip(n, lat, strict=True))))
        panels[1].append((f"{label}: decider", list(zip(n, dec, strict=True))))
        panels[1].append((f"{label}: participant", list(zip(n, par, strict=True))))
    out = []
    for k, (title, curves) in enumerate(zip(("commit s", "peer MB/commit"), panels, strict=True)):
        x0 = 320 * k
        top = max((v for _, pts in curves for _, v in pts), default=1.0) or 1.0
        out.append(f'<text x="{x0 + 10}" y="16" font-size="12">{title} (max {top:.3g})</text>')

        def px(node: int, x0: int = x0) -> float:
            return x0 + 20 + 260 * xs.index(node) / max(1, len(xs) - 1)

        for j, (label, pts) in enumerate(curves):
            color = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")[j % 6]
            line = " ".join(f"{px(x):.0f},{280 - 240 * v / top:.0f}" for x, v in pts)
            out.append(f'<polyline fill="none" stroke="{color}" points="{line}"/>')
            out.append(
                f'<text x="{x0 + 30}" y="{34 + 12 * j}" font-size="9" fill="{color}">{label}</text>'
            )
        out.extend(f'<text x="{px(x):.0f}" y="298" font-size="10">{x}</text>' for x in xs)
    body = "\n".join(out)
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="640" height="310">\n{body}\n</svg>\n'


def _run_label(doc: dict[str, Any], path: Path) -> str:
    """A run's legend entry without --labels: what it ran (its tag) and at which commit, so a
    reader of the plot can tell the runs apart ("before" alone says nothing)."""
    machine = doc.get("machine", {})
    tag = machine.get("args", {}).get("tag") or path.stem
    commit = machine.get("commit")
    return f"{tag} (commit {commit[:7]})" if commit else tag


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def main() -> None:
    args = parse_args()
    if args.replot:
        series = []
        labels = args.labels.split(";") if args.labels else []
        for i, path in enumerate(args.replot):
            doc = json.loads(path.read_text())
            label = labels[i] if i < len(labels) else _run_label(doc, path)
            series.append((label, doc["results"]))
        plot(series, args.plot or Path("scale.png"))
        return
    rows: list[dict[str, Any]] = []
    meta_cache: dict[Any, Any] = {}
    for n in args.node_counts:
        load = os.getloadavg()[0]
        print(f"N={n}: {n * args.ranks} ranks, load average {load:.2f} ...", flush=True)
        row = run_n(args, n, meta_cache)
        row["load_before"] = load
        rows.append(row)
        print(table([row], ""), flush=True)
    md = table(rows, args.tag)
    print(md)
    info = {
        "commit": _commit(),  # the legend names each run by it (--replot)
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, int | str | list)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "results": rows}, indent=2) + "\n")
    print(f"results written to {args.out}")
    if args.md is not None:
        args.md.write_text(md)
    if args.plot is not None:
        plot([(args.tag or "this run", rows)], args.plot)


if __name__ == "__main__":
    main()
