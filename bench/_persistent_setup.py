"""The stage of ``persistent_tier.py``: the SeaweedFS bucket, the daemon persisting to it, and
the raw baseline's bytes and its upload child (``--child-put``)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tierckpt_core.launcher import DaemonProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from seaweed import SeaweedS3  # test helper: S3 on loopback

NAMESPACE = "bench"
BUCKET = "tierckpt-bench"
REGION = "us-east-1"
TIER_PREFIX = "tier"
CHUNK = 8 * 1024 * 1024  # tierckpt's streaming chunk and CRT part size; raw uses the same
POLL_S = 0.02
SCRIPT = Path(__file__).resolve().with_name("persistent_tier.py")  # runs the --child-put child


class Daemon(DaemonProcess):
    """A daemon persisting to the SeaweedFS bucket, its own tmpfs dir."""

    def __init__(self, s3: SeaweedS3, tag: str) -> None:
        super().__init__(
            Path(f"/dev/shm/tierckpt-bench-s3-{tag}"),
            log_path=Path(tempfile.gettempdir()) / f"tierckpt-bench-s3-{tag}.log",
            extra_env=s3.env(),
            port=0,
            capacity="12G",
            keep_last=2,
            persist_url=f"s3://{BUCKET}/{TIER_PREFIX}",
            persist_keep_last=2,
            log_level="INFO",
        )
        self.concurrency: int | None = None

    def start_with(self, concurrency: int | None = None) -> None:
        """Start with ``concurrency`` upload threads, once the persistent tier answers."""
        self.settings.pop("upload_concurrency", None)
        if concurrency is not None:
            self.settings["upload_concurrency"] = concurrency
        self.concurrency = concurrency
        os.environ["TIERCKPT_SOCKET"] = str(self.socket)
        self.start(ready=_persistent_tier_checked)

    def wipe_restart(self, concurrency: int | None = None) -> None:
        """A rebooted node: the daemon and everything in its memory tier are gone."""
        self.lose_node()
        self.start_with(concurrency)


def _persistent_tier_checked(status: dict[str, Any]) -> bool:
    persistent = status.get("persistent") or {}
    if persistent.get("healthy") is False:
        raise RuntimeError(f"persistent tier unusable: {persistent.get('last_error')}")
    return persistent.get("healthy") is True


def raw_source(sd: dict[str, torch.Tensor], length: int) -> memoryview:
    """``length`` bytes holding the state's tensor bytes (the same data the tier uploads)."""
    buf = torch.zeros(length, dtype=torch.uint8)
    off = 0
    for t in sd.values():
        b = t.view(torch.uint8)
        n = min(b.numel(), length - off)
        buf[off : off + n] = b[:n]
        off += n
    return memoryview(buf.numpy()).cast("B")


def child_put(sizes: str, endpoint: str) -> None:
    """``--child-put``: upload objects of these sizes once the parent says go (slowdown baseline)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    lengths = [int(x) for x in sizes.split(",")]
    client = S3Client(
        REGION,
        endpoint=endpoint,
        s3client_config=S3ClientConfig(part_size=CHUNK, force_path_style=True),
    )
    gen = torch.Generator().manual_seed(1)
    src = memoryview(torch.randn(max(lengths) // 4 + 1, generator=gen).numpy()).cast("B")
    print("ready", flush=True)
    sys.stdin.readline()
    for i, length in enumerate(lengths):
        with client.put_object(BUCKET, f"raw-bg/obj{i}") as w:
            for off in range(0, length, CHUNK):
                w.write(src[off : min(off + CHUNK, length)])
