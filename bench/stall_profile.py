"""Where a 64 MiB ``async_save`` stall goes, phase by phase (issue 35), on a quiet host.

One process, a real daemon, the stall state of ``stall.py`` (16 float32 tensors under one key),
``--iters`` rounds, interleaved: a memcpy of the state into pre-touched tensors (the floor), then

- ``tierckpt``: ``dcp.async_save`` with ``TieredStorageWriter`` (THREAD), its stall broken into
  phases by wrapping the functions it runs on the training thread (a ``perf_counter`` pair each):
  DCP's ``_stateful_to_state_dict``, the writer's ``stage`` and inside it the layout's plan
  (``SaveAssignment.plan``), ``staging_size``, the pre-leased file's claim, ``stage_into`` and
  inside it the byte copy's ``run`` (helpers woken, the copy), then DCP's executor start
  (``execute_save``: a new thread per save) and the rest (DCP's own code between them);
- ``torch``: ``dcp.async_save`` with a reused ``DefaultStager`` into /dev/shm (``stall.py``'s);
- ``tierckpt direct``: the writer's ``stage`` on the training thread, then ``dcp.save`` of the
  staged dict submitted to one long-lived thread: what a save costs without ``async_save``'s
  per-save thread and wrappers (what ``Checkpointer`` could do).

Medians in ms over the rounds after ``--warmup``, and each over the same round's memcpy.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import shutil
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from harness import machine_info, start_daemon, write_results
from stall import _ReusedStager, state, tensors
from torch.distributed.checkpoint import FileSystemWriter, _async_thread_executor
from torch.distributed.checkpoint import state_dict_saver as saver
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client.dcp import _assign, _byte_copy, _prelease, _staging
from tierckpt_client.dcp import writer as writer_mod
from tierckpt_client.dcp.writer import TieredStorageWriter

THREAD = AsyncCheckpointerType.THREAD
PHASES: dict[str, float] = defaultdict(float)


@contextlib.contextmanager
def timed(owner: Any, name: str, phase: str) -> Iterator[None]:
    """``owner.name`` wrapped: its time added to ``PHASES[phase]`` (restored on the way out)."""
    real = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            PHASES[phase] += time.perf_counter() - t0

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, real)


def memcpy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=64)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: as is)")
    p.add_argument("--out", default="bench/results/stall_profile.json")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    daemon = start_daemon(args.size_mb * 8, keep_last=2)
    tmp = tempfile.mkdtemp(dir="/dev/shm", prefix="stall-profile-")
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="direct-save")
    sd = state(args.size_mb)
    dst = [torch.empty_like(t).fill_(1) for t in tensors(sd)]
    stager = _ReusedStager(StagingOptions(False, False, False, False))
    rows: dict[str, list[float]] = defaultdict(list)
    step = 0
    wraps = [
        (saver, "_stateful_to_state_dict", "DCP _stateful_to_state_dict"),
        (TieredStorageWriter, "stage", "writer.stage (all of it)"),
        (_assign.SaveAssignment, "plan", "  layout plan (SaveAssignment.plan)"),
        (writer_mod, "staging_size", "  staging_size"),
        (_prelease.NextFile, "claim", "  pre-leased file claimed"),
        (writer_mod, "stage_into", "  stage_into (the copy and its layout)"),
        (_staging, "_walk", "    layout walk (tensors placed)"),
        (_byte_copy, "on_helpers", "      helpers woken"),
        (_byte_copy.ByteCopies, "run", "    byte copy run (helpers woken, the copy, joined)"),
        (
            _async_thread_executor._ThreadBasedAsyncCheckpointExecutor,
            "execute_save",
            "DCP executor start (a thread per save)",
        ),
    ]
    try:
        for i in range(args.iters):
            keep = i >= args.warmup
            base = memcpy(dst, tensors(sd))
            # tierckpt through async_save, with phases
            step += 1
            w = TieredStorageWriter("prof", step=step)
            PHASES.clear()
            with contextlib.ExitStack() as stack:
                for owner, name, phase in wraps:
                    stack.enter_context(timed(owner, name, phase))
                t0 = time.perf_counter()
                fut = dcp.async_save(
                    sd, storage_writer=w, async_checkpointer_type=THREAD, no_dist=True
                )
                stall = time.perf_counter() - t0
            fut.result()
            if keep:
                rows["memcpy"].append(base)
                rows["tierckpt stall"].append(stall)
                for k, v in PHASES.items():
                    rows[k].append(v)
                named = sum(
                    v for k, v in PHASES.items() if not k.startswith(" ") and "all of it" not in k
                )
                rows["rest (DCP's own between them)"].append(
                    stall - named - PHASES["writer.stage (all of it)"]
                )
            # tierckpt, direct
            step += 1
            w = TieredStorageWriter("prof", step=step)
            t0 = time.perf_counter()
            staged = w.stage(sd)
            f2 = pool.submit(dcp.save, staged, storage_writer=w, no_dist=True)
            direct = time.perf_counter() - t0
            f2.result()
            # torch's reused stager
            t0 = time.perf_counter()
            f3 = dcp.async_save(
                sd,
                storage_writer=FileSystemWriter(f"{tmp}/{i % 2}", overwrite=True),
                async_stager=stager,
                async_checkpointer_type=THREAD,
                no_dist=True,
            )
            torch_stall = time.perf_counter() - t0
            f3.result()
            if keep:
                rows["tierckpt direct (stage, then dcp.save on a long-lived thread)"].append(direct)
                rows["torch reused stager stall"].append(torch_stall)
            time.sleep(0.05)
    finally:
        pool.shutdown()
        stager.close()
        daemon.stop(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    base = rows["memcpy"]
    res = {}
    threads = torch.get_num_threads()
    print(f"| {args.size_mb} MiB, {threads} threads, {len(base)} rounds | median ms | x memcpy |")
    print("|---|---:|---:|")
    for k, v in rows.items():
        med = statistics.median(v)
        ratio = statistics.median(x / b for x, b in zip(v, base, strict=True))
        res[k] = {"median_ms": med * 1e3, "x_memcpy": ratio}
        print(f"| {k} | {med * 1e3:.2f} | {ratio:.2f}x |")
    write_results(
        Path(args.out),
        machine_info(size_mb=args.size_mb, threads=threads),
        res,
    )


if __name__ == "__main__":
    main()
