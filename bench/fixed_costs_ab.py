"""The fixed costs of a save's stall and a restore (issue 35), A/B in one run, rounds alternating
between the code before (DCP's DEBUG records built, no pin sent ahead on a first load, the
metadata decoded for every step) and after. Prints the medians of each side's wall and
training-thread CPU ms, and after/before. ``MB`` (64) and ``N`` (24 rounds) from the environment.

    python bench/fixed_costs_ab.py
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.logger import _dcp_logger
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import tierckpt_client.dcp._metadata_codec as codec
from tierckpt_client import _reads
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.launcher import DaemonProcess

MB = int(os.environ.get("MB", "64"))
N = int(os.environ.get("N", "24"))
root = Path(tempfile.mkdtemp(prefix="ab", dir="/dev/shm"))
d = DaemonProcess(
    root / "tier",
    log_path=root / "d.log",
    port=0,
    capacity=f"{4 * MB + 256}M",
    keep_last=2,
    log_level="WARNING",
).start()
os.environ["TIERCKPT_SOCKET"] = str(d.socket)
cfg = ClientConfig.from_env()
numel = MB * (1 << 20) // 16 // 4
sd = {f"w{i:02d}": torch.randn(numel) for i in range(16)}
dst = {k: torch.zeros_like(v) for k, v in sd.items()}
src = {k: torch.ones_like(v) for k, v in sd.items()}
real_ahead = _reads.pin_ahead


def _no_pin_ahead(*args: Any) -> bool:
    return False


res: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
TieredStorageWriter("p", step=1)  # the logger set once
for step in range(1, N + 1):
    after = step % 2 == 0
    _dcp_logger.setLevel(logging.INFO if after else logging.DEBUG)
    if after:
        _reads.pin_ahead = real_ahead
    else:
        _reads.pin_ahead = _no_pin_ahead
        codec._DECODED.clear()
    t0 = time.perf_counter()
    for k in sd:
        src[k].copy_(sd[k])
    memcpy = time.perf_counter() - t0
    w = TieredStorageWriter("p", step=step)
    t0, c0 = time.perf_counter(), time.thread_time()
    fut = dcp.async_save(
        sd, storage_writer=w, async_checkpointer_type=AsyncCheckpointerType.THREAD, no_dist=True
    )
    stall, stall_cpu = time.perf_counter() - t0, time.thread_time() - c0
    fut.result()
    for v in dst.values():
        v.zero_()
    r = TieredStorageReader("p", step=step, config=cfg)
    t0, c0 = time.perf_counter(), time.thread_time()
    dcp.load(dst, storage_reader=r, no_dist=True)
    rest, rest_cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert all(torch.equal(dst[k], sd[k]) for k in sd)
    if step > 4:
        tag = "after" if after else "before"
        for k, v in (
            ("memcpy", memcpy),
            ("stall", stall),
            ("stall cpu", stall_cpu),
            ("restore", rest),
            ("restore cpu", rest_cpu),
            ("stall/memcpy", stall / memcpy),
            ("restore/memcpy", rest / memcpy),
        ):
            res[(k, tag)].append(v)
print(
    f"load {os.getloadavg()[0]:.1f}; {MB} MiB; {len(res[('stall', 'after')])} rounds each, alternating"
)
for k in (
    "memcpy",
    "stall",
    "stall cpu",
    "restore",
    "restore cpu",
    "stall/memcpy",
    "restore/memcpy",
):
    b, a = statistics.median(res[(k, "before")]), statistics.median(res[(k, "after")])
    sc = 1 if "/" in k else 1e3
    print(f"{k:16s} before {b * sc:8.2f}  after {a * sc:8.2f}  after/before {a / b:.2f}")
d.stop(timeout=10)
