"""Persistent-tier benchmark: tierckpt's S3 upload and restore vs. raw s3torchconnector.

Starts its own SeaweedFS (a real S3 server, loopback, fresh temp dir) and a real daemon with
``TIERCKPT_PERSIST_URL=s3://...``, then measures side by side against that one server
(see bench/README.md):
(1) upload: save returned -> step DURABLE, vs. raw ``S3Client.put_object`` of the same object sizes,
    vs. ``s3torchconnector.dcp.S3StorageWriter``;
(2) restore after wiping the daemon's memory: ``dcp.load`` with ``TieredStorageReader`` (hydrate from
    S3, verify, copy), vs. raw CRT ``get_object`` of the same objects, vs. ``S3StorageReader``;
(3) slowdown of a CPU training loop while the daemon uploads in the background.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
from _persistent_bench import Bench
from _persistent_report import render, summarize
from _persistent_report import rows as rows  # the suite's rows
from _persistent_setup import BUCKET, TIER_PREFIX, Daemon, SeaweedS3, child_put
from harness import machine_info, sized_child, write_results


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=512, help="tensor bytes of the state dict (MiB)")
    p.add_argument("--tensors", type=int, default=8, help="float32 tensors in the state dict")
    p.add_argument("--iters", type=int, default=3, help="repetitions per measurement (median)")
    p.add_argument("--loop-s", type=float, default=2.5, help="victim training loop length (s)")
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="saves uploaded before the measured ones (default 3 = the daemon's keep_last + 1): "
        "until then the daemon pre-faults spare tier files for the next saves beside the upload, "
        "which a long training run does not see (0 in --smoke)",
    )
    p.add_argument("--no-torch-s3", action="store_true", help="skip s3torchconnector's DCP classes")
    p.add_argument(
        "--server-nice",
        type=int,
        default=19,
        help="niceness of the SeaweedFS process: it stands in for a remote S3 service, so on a "
        "small machine its CPU should not come out of the training loop's share (0: as is)",
    )
    p.add_argument(
        "--restore-only",
        action="store_true",
        help="measure only the restore rows (2): one save and one S3StorageWriter save to read "
        "back, no upload comparison, no training-loop slowdown",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/persistent_tier.json"))
    p.add_argument("--smoke", action="store_true", help="32 MiB, 1 iteration, short loop (CI)")
    p.add_argument("--child-put", help=argparse.SUPPRESS)  # internal: the raw upload baseline
    p.add_argument("--child-endpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_put:
        return args
    if args.smoke:
        args.size_mb, args.iters, args.loop_s, args.warmup = 32, 1, 0.25, 0
    if args.iters < 1:
        p.error("--iters must be at least 1")
    return args


WHAT = "persistent tier (SeaweedFS S3)"


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """The suite's run: at ``--s3-size-mb`` (this script's default if unset)."""
    return sized_child("persistent_tier.py", WHAT, args, "no_s3", "s3_size_mb", tmp, notes)


def main() -> None:
    args = parse_args()
    if args.child_put:
        child_put(args.child_put, args.child_endpoint)
        return
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    tag = uuid.uuid4().hex[:8]
    import s3torchconnector

    info = machine_info(
        s3torchconnector=s3torchconnector.__version__,
        size_mb=args.size_mb,
        tensors=args.tensors,
        iters=args.iters,
        loop_s=args.loop_s,
        server_nice=args.server_nice,
    )
    print(
        f"machine: {info['cores']} cores, {info['mem_gib']} GiB, torch {info['torch']}, "
        f"s3torchconnector {info['s3torchconnector']}, python {info['python']}; "
        f"{args.size_mb} MiB in {args.tensors} tensors x {args.iters} iters"
    )
    s3 = SeaweedS3(BUCKET, nice=args.server_nice)
    daemon: Daemon | None = None
    bench: Bench | None = None
    try:
        s3.start()
        print(f"SeaweedFS at {s3.endpoint} (data in {s3.dir}), ready in {s3.startup_s:.2f}s")
        # The bench process's own S3 clients (raw, s3torchconnector DCP) use the same server and
        # credentials; S3StorageWriter/Reader take no endpoint, the CRT reads AWS_ENDPOINT_URL.
        # TIERCKPT_PERSIST_URL: the trainer knows the persistent tier, so a restore of a step in
        # no node's memory reads it straight from S3 (restore_tier_daemon turns that off).
        os.environ.update(
            s3.env(),
            AWS_ENDPOINT_URL=s3.endpoint,
            TIERCKPT_PERSIST_URL=f"s3://{BUCKET}/{TIER_PREFIX}",
        )
        daemon = Daemon(s3, tag)
        daemon.start_with()
        bench = Bench(args, s3, daemon)
        res = bench.run()
    except BaseException:
        if daemon is not None:
            print(f"daemon log (tail):\n{daemon.log()}", file=sys.stderr)
        print(f"SeaweedFS log (tail):\n{s3.log()[-2000:]}", file=sys.stderr)
        raise
    finally:
        if bench is not None:
            bench.boto.close()
        if daemon is not None:
            daemon.cleanup()
        s3.stop()
    summarize(res)
    print(render(res))
    write_results(args.out, info, res)


if __name__ == "__main__":
    main()
