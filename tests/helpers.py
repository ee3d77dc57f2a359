"""Test helpers: real daemons in subprocesses on real Unix sockets (the project's one launcher,
:mod:`tierckpt_daemon.launcher`), and spawned gloo ranks."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierckpt_daemon import launcher
from tierckpt_daemon.launcher import DaemonProcess, free_port, ring

__all__ = ["DaemonProcess", "free_port", "new_shm_dir", "ring", "run_ranks"]


def new_shm_dir() -> Path:
    return launcher.new_shm_dir("tierckpt-test")


def _rank_entry(
    rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple[Any, ...]
) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes on one gloo group."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
