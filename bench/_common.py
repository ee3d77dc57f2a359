"""Shared by the benchmark scripts (run as ``python bench/<script>.py``)."""

from __future__ import annotations

import os
import platform
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
