"""The scale and recovery model of docs/scale.md: what one commit across nodes costs, and how long a
restore takes, at a given cluster size. Costs per message and per byte are the ones fitted from
``bench/scale.py`` runs (docs/scale.md, "Fitted costs"); change them with the flags.

    python bench/scale_model.py                      # the tables of docs/scale.md
    python bench/scale_model.py --nodes 100,1000,2000 --ranks 8 --tensors 300 --fanout 16
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

MB = 1e6
GB = 1e9


@dataclass(frozen=True)
class Costs:
    msg_s: float = 2.2e-3  # decider CPU per peer message (request + answer)
    send_s_per_mb: float = 0.060  # CPU to encode and send one MB of record (per message today)
    parse_s_per_mb: float = 0.046  # CPU to receive, validate and write one MB of record
    copy_gbps: float = 2.0  # one already-encoded message pushed through a socket, GB/s
    entry_b: float = 205  # DCP metadata per (rank, tensor) chunk, JSON codec
    file_b: float = 36e3  # a file record with its block checksums (1,024 blocks), stored
    file_wire_b: float = 72e3  # the same in a prepare answer (as measured)
    # The global record per other node's share (9009762): its entry (node name, digest of its
    # records, bytes; ~125 B) and each of its files' names (~15 B). Before 9009762 a slim record
    # per file (name, rank, length, checksum, node: ~150 B) and a bare digest (~100 B).
    slim_file_b: float = 15
    node_b: float = 125
    # What a node that is not a holder keeps of the ring (5ce84d0: the share table stays on the
    # holders): the table's and the metadata's digests and the holders' names.
    ring_digests_b: float = 300
    cand_s: float = 2.2e-3  # the asker's CPU per peer asked by candidates
    # Inflate, json.loads and decode_metadata, per chunk entry, as a reader does it since 05d70cc
    # (the garbage collector paused: bench/decode_metadata.py, 8.3-10.6 us; 20-24 us before).
    decode_us_per_entry: float = 10.0
    # The metadata as the writer sends it since 075a2e0 (JSON, zlib level 1, base64): the
    # coordinator's CPU to encode DCP's Metadata and pack it, per MB of JSON (677 ms for 42 MB at
    # 1,024 ranks, bench/decode_metadata.py), and JSON bytes per byte of text (12-29x measured on
    # bench/scale.py's FSDP shapes; 10 assumed for a real model's less regular names).
    pack_s_per_mb: float = 16e-3
    meta_ratio: float = 10.0


@dataclass(frozen=True)
class Job:
    nodes: int
    ranks: int  # per node
    tensors: int  # sharded over every rank
    link_gbps: float  # per node, Gb/s
    fanout: int  # tree fan-out of the new protocol
    holders: int  # nodes that keep the DCP metadata (decider + next)


def old_commit(j: Job, c: Costs) -> dict[str, float]:
    """Today: every file record (block checksums) and the whole metadata to every participant,
    one request per participant from the decider, each encoded anew."""
    n, m = j.nodes, j.ranks
    meta = n * m * j.tensors * c.entry_b
    record = meta + n * m * c.file_b
    sent = (n - 1) * record
    cpu = 2 * (n - 1) * c.msg_s + sent / MB * c.send_s_per_mb
    nic = sent / (j.link_gbps / 8 * GB)
    parse = record / MB * c.parse_s_per_mb
    return {
        "metadata_MB": meta / MB,
        "record_MB": record / MB,
        "decider_msgs": 2 * (n - 1),
        "decider_sent_MB": sent / MB,
        "participant_recv_MB": record / MB,
        "participant_keeps_MB": record / MB,
        "decider_cpu_s": cpu,
        "latency_s": cpu + parse + nic,
        "candidates_s": (n - 1) * c.cand_s,
    }


def new_commit(j: Job, c: Costs, *, tree: bool = True) -> dict[str, float]:
    """The redesign: the global record holds an entry per node's share (digest, file names); the
    metadata goes to ``holders`` nodes only; prepare and decision travel down a tree of fan-out
    ``fanout`` (``tree=False``: one request per participant from the decider, as the first step
    of the redesign does), each message encoded once and sent to every child."""
    n, m = j.nodes, j.ranks
    meta = n * m * j.tensors * c.entry_b
    record = n * (c.node_b + m * c.slim_file_b)
    f = j.fanout if tree else n - 1
    depth = max(1, math.ceil(math.log(n, j.fanout))) if tree else 1
    per_child = c.msg_s + record / (c.copy_gbps * GB)
    level = record / MB * (c.parse_s_per_mb + c.send_s_per_mb) + f * per_child
    nic = f * record / (j.link_gbps / 8 * GB)
    # Prepare down and its answers up (each node's slim records, growing to the record at the
    # root), then the decision down: three passes over the tree.
    tree_s = 3 * depth * (level + nic)
    # The metadata: packed by the writer (075a2e0; before it, encoded about as long: not in the
    # latency, see writer_encode_s), then into the decider's daemon and on to the other holders
    # as opaque text, hashed, never parsed.
    text = meta / c.meta_ratio
    meta_s = text * j.holders / (c.copy_gbps * GB)
    # Before 075a2e0: the JSON object, parsed, hashed and re-encoded by the decider's daemon.
    meta_parsed_s = meta / MB * (c.parse_s_per_mb + (j.holders - 1) * c.send_s_per_mb)
    return {
        "metadata_MB": meta / MB,
        "metadata_text_MB": text / MB,
        "record_MB": record / MB,
        "decider_msgs": 2 * f + (j.holders - 1),
        "decider_sent_MB": (f * record + (j.holders - 1) * text) / MB,
        "participant_recv_MB": record / MB,
        "participant_keeps_MB": (c.ring_digests_b + m * c.file_b) / MB,
        "holder_keeps_MB": (record + text + m * c.file_b) / MB,
        "tree_depth": depth,
        "latency_s": tree_s + meta_s,
        "latency_parsed_meta_s": tree_s + meta_parsed_s,
        "writer_encode_s": meta / MB * c.pack_s_per_mb,
        "candidates_s": 2 * c.msg_s,
    }


def restore(
    state_b: float, nodes: int, ranks: int, tensors: int, link_gbps: float, c: Costs, **kw: float
) -> dict[str, float]:
    """RTO of one lost node from its replica holder, and of the whole job from S3."""
    restart_s = kw.get("restart_s", 30.0)  # the replacement scheduled and its daemon up
    ingest = kw.get("node_ingest_gbs", 2.9)  # GB/s a node takes in from a peer today
    s3_node = kw.get("s3_node_gbs", 5.0)  # GB/s one node reads from S3 at best
    share = state_b / nodes
    link = link_gbps / 8  # GB/s
    meta_s = nodes * ranks * tensors * c.decode_us_per_entry * 1e-6  # every rank decodes it
    out = {
        "share_GB": share / GB,
        "peer_today_s": share / GB / min(link, ingest),
        "peer_line_s": share / GB / link,
        "metadata_decode_s": meta_s,
    }
    out["rto_peer_s"] = restart_s + out["peer_today_s"] + meta_s
    for cap in (100.0, 1000.0):  # GB/s the bucket serves the job in all
        rate = min(cap, nodes * min(link, s3_node))
        out[f"s3_{cap:g}_s"] = state_b / GB / rate
        out[f"rto_s3_{cap:g}_s"] = restart_s + out[f"s3_{cap:g}_s"] + meta_s
    return out


def _row(values: list[str]) -> str:
    return "| " + " | ".join(values) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="100,1000,2000")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--link-gbps", type=float, default=100.0)
    p.add_argument("--fanout", type=int, default=8)  # TIERCKPT_COMMIT_FANOUT
    p.add_argument("--holders", type=int, default=2)
    p.add_argument("--params", type=float, default=70e9, help="model parameters")
    p.add_argument("--bytes-per-param", type=float, default=16.0)
    args = p.parse_args()
    c = Costs()
    ns = [int(x) for x in args.nodes.split(",")]

    def fmt(v: float) -> str:
        if v >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}"

    print(
        f"Commit, {args.ranks} ranks per node, {args.tensors} tensors sharded over every rank, "
        f"{args.link_gbps:g} Gb/s links, fan-out {args.fanout}, metadata on {args.holders} nodes\n"
    )
    keys = [
        ("metadata_MB", "DCP metadata, MB"),
        ("metadata_text_MB", "... as the daemons keep it (compressed text), MB"),
        ("record_MB", "global record, MB"),
        ("decider_msgs", "decider messages"),
        ("decider_sent_MB", "decider sends, MB"),
        ("participant_recv_MB", "participant receives, MB"),
        ("participant_keeps_MB", "participant keeps per step, MB"),
        ("holder_keeps_MB", "a holder keeps per step, MB"),
        ("latency_s", "time to committed, s"),
        ("latency_parsed_meta_s", "... with the metadata parsed by the daemon (before 075a2e0), s"),
        ("writer_encode_s", "the coordinator encodes the metadata before, s"),
        ("candidates_s", "candidates, s (asker's CPU)"),
    ]
    print(_row(["", *[f"{n} nodes: old" for n in ns], *[f"{n}: new" for n in ns]]))
    print(_row(["---"] + ["---:"] * (2 * len(ns))))
    jobs = [Job(n, args.ranks, args.tensors, args.link_gbps, args.fanout, args.holders) for n in ns]
    old = [old_commit(j, c) for j in jobs]
    new = [new_commit(j, c) for j in jobs]
    flat = [new_commit(j, c, tree=False) for j in jobs]
    for key, label in keys:
        cells = [fmt(r[key]) if key in r else "-" for r in old + new]
        print(_row([label, *cells]))
    flat_once = [fmt(r["latency_s"]) for r in flat]
    flat_each = [
        fmt(r["latency_s"] + (j.nodes - 1) * r["record_MB"] * c.send_s_per_mb)
        for j, r in zip(jobs, flat, strict=True)
    ]
    print(_row(["new, no tree, decision encoded once, s", *["-"] * len(ns), *flat_once]))
    print(_row(["new, no tree, encoded per participant, s", *["-"] * len(ns), *flat_each]))
    state = args.params * args.bytes_per_param
    print(
        f"\nRestore, state {state / 1e12:.2f} TB ({args.params:g} params x {args.bytes_per_param:g} B)"
    )
    cols = [
        ("share_GB", "share GB"),
        ("peer_today_s", "share from peer, today (2.9 GB/s), s"),
        ("peer_line_s", "share from peer at line rate, s"),
        ("metadata_decode_s", "metadata decode per rank, s"),
        ("rto_peer_s", "RTO one node, s"),
        ("s3_100_s", "job from S3 at 100 GB/s, s"),
        ("s3_1000_s", "job from S3 at 1 TB/s, s"),
        ("rto_s3_100_s", "RTO job (100 GB/s), s"),
    ]
    print(_row(["nodes", "link Gb/s", *[label for _, label in cols]]))
    print(_row(["---:"] * (2 + len(cols))))
    for n in ns:
        for link in (25.0, 100.0, 400.0):
            r = restore(state, n, args.ranks, args.tensors, link, c)
            print(_row([str(n), f"{link:g}", *[fmt(r[k]) for k, _ in cols]]))
    print(
        "\nRTO = 30 s to schedule the replacement and start its daemon + transfer + metadata decode"
    )


if __name__ == "__main__":
    main()
