"""Shared by the benchmark scripts (run as ``python bench/<script>.py``)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tierckpt_core.launcher import free_port  # noqa: F401 (the benches' one port picker)


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


# -- CPU accounting -----------------------------------------------------------------------------


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of a process; ``None`` = this one."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def system_cpu() -> list[int]:
    """The machine's CPU jiffies from /proc/stat: user nice system idle iowait irq softirq steal."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def busy_cores(a: list[int], b: list[int]) -> float:
    """Average cores busy between two system_cpu() samples (all but idle and iowait)."""
    d = [y - x for x, y in zip(a, b, strict=True)]
    total = sum(d) or 1
    return (total - d[3] - d[4]) / total * len(os.sched_getaffinity(0))


def steal_cores(a: list[int], b: list[int]) -> float:
    d = [y - x for x, y in zip(a, b, strict=True)]
    return d[7] / (sum(d) or 1) * len(os.sched_getaffinity(0))


# -- a state dict and a training loop to measure beside ------------------------------------------

MM_SIZE = 512


def make_state(size_mb: int, n: int) -> dict[str, torch.Tensor]:
    numel = size_mb * (1 << 20) // n // 4
    gen = torch.Generator().manual_seed(0)
    return {f"w{i:02d}": torch.randn(numel, generator=gen) for i in range(n)}


def mutate(sd: dict[str, torch.Tensor]) -> None:
    for t in sd.values():
        t[0] += 1


def check_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    bad = [k for k, v in want.items() if not torch.equal(got[k], v)]
    if bad:
        raise AssertionError(f"{what}: loaded state differs from the saved one ({bad})")


def victim(a: torch.Tensor, b: torch.Tensor, steps: int) -> None:
    """The 'training loop': single-threaded 512x512 matmuls."""
    c = torch.empty_like(a)
    for _ in range(steps):
        torch.mm(a, b, out=c)
        a, c = c.mul_(1e-3), a
