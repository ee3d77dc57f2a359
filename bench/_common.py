"""Shared by the benchmark scripts (run as ``python bench/<script>.py``)."""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch


def machine_info(**extra: Any) -> dict[str, Any]:
    """The machine and software versions, plus the run's own settings (``extra``)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cores": len(os.sched_getaffinity(0)),
        "mem_gib": round(mem / (1 << 30), 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **extra,
    }


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_rates(res: dict[str, Any], keys: Iterable[str]) -> None:
    """For each row ``res[key]`` with seconds ``s`` and ``bytes``: its median and MB/s (10^6)."""
    for key in keys:
        if key in res:
            r = res[key]
            r["median_s"] = statistics.median(r["s"])
            r["mbps"] = r["bytes"] / r["median_s"] / 1e6


def write_results(path: Path, info: dict[str, Any], res: dict[str, Any]) -> None:
    """The run's JSON: the machine and settings, and every result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": info, "results": res}, indent=2) + "\n")
    print(f"results written to {path}")
