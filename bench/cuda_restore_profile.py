"""Where a restore into CUDA tensors spends what it takes beyond the DMA (issue 36), on a CUDA host.

Each round saves a new step (a resume reads a step it never read) and then times, interleaved:

- ``raw_h2d``: the H2D copies from a pinned buffer (the floor the target is stated against);
- ``mapped_h2d``: the same copies out of the step's tier file, mapped and registered, no checks
  (the DMA the restore does, alone);
- ``land``: ``_device_copy.land`` on those copies: the DMA with the block checks beside it (what
  the load does once DCP and the daemon are out of the way: the checks' cost to the DMA);
- ``restore``: ``dcp.load`` through ``TieredStorageReader``, verified, phase by phase
  (``_restore_phases``);
- ``restore_unverified``: the same with ``verify_reads=False``.

(Copying each block only once it is checked, the DMA following the checks' front, was tried
and measured slower at 64 MiB, 1 and 4 GiB: docs/benchmarks.md.) Then one more restore under
``cProfile`` (the functions by own time and by cumulative time), so
the milliseconds outside the DMA can be named.

    python bench/cuda_restore_profile.py --gib 1 --iters 7 --out results/cuda_restore.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _restore_phases import RestorePhases, line, summary
from harness import machine_info, make_state, start_daemon

from tierckpt_client import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _arena, _device_copy
from tierckpt_core.manifest import FileRecord
from tierckpt_core.verified import BlockSums

N_TENSORS = 16
NS = "cudaprof"


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument(
        "--verify-threads",
        default="",
        help="comma-separated thread counts checking the blocks (default: torch's intra-op "
        "threads); each one more contender, restore_t<N>",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    shm = Path(tempfile.mkdtemp(prefix="tierckpt-cudaprof-", dir="/dev/shm"))
    d = start_daemon(int(5 * args.gib * 1024) + 1024, keep_last=2, shm_dir=shm, set_env=False)
    try:
        return run(args, d)
    finally:
        d.cleanup()  # its dir and its log


def run(args: argparse.Namespace, d: Any) -> int:
    cfg = ClientConfig.from_env(socket=d.socket)
    unverified = ClientConfig.from_env(socket=d.socket, verify_reads=False)
    daemon = DaemonClient.shared(cfg)
    sd = make_state(args.gib * 1024, N_TENSORS, extra={"step": 0}, device="cuda")
    src = [v for v in sd.values() if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    pinned = [torch.empty_like(t, device="cpu").pin_memory() for t in src]
    dst = [torch.empty_like(t) for t in src]
    res: dict[str, list[float]] = {}
    phases = RestorePhases().install()
    sweep = [int(t) for t in args.verify_threads.split(",") if t]
    phase_runs: dict[str, list[dict[str, float]]] = {
        k: [] for k in ["restore", *(f"restore_t{t}" for t in sweep), "restore_unverified"]
    }

    def add(key: str, s: float) -> None:
        res.setdefault(key, []).append(s)

    def restore(step: int, config: ClientConfig, key: str) -> None:
        out: dict[str, Any] = {f"w{i:02d}": torch.empty_like(t) for i, t in enumerate(src)}
        out["extra"] = {"step": -1}

        def load() -> None:
            with phases.measure() as ph:
                dcp.load(
                    out, storage_reader=TieredStorageReader(NS, step, config=config), no_dist=True
                )
            phase_runs[key].append(ph)

        add(key, timed(load))
        assert out["extra"]["step"] == step
        assert all(torch.equal(out[f"w{i:02d}"], t) for i, t in enumerate(src)), key

    def save(step: int) -> None:
        sd["extra"]["step"] = step
        dcp.save(sd, storage_writer=TieredStorageWriter(NS, step, config=cfg), no_dist=True)

    step = 0
    for _ in range(args.iters + 1):
        step += 1  # each load a step this process never read, as a resume's
        save(step)
        restore(step, cfg, "restore")
        for t in sweep:
            step += 1
            save(step)
            _device_copy.VERIFY_THREADS = t
            try:
                restore(step, cfg, f"restore_t{t}")
            finally:
                _device_copy.VERIFY_THREADS = None
        step += 1
        save(step)
        restore(step, unverified, "restore_unverified")
        refs = TieredStorageReader(NS, step, config=cfg).read_metadata().storage_data
        pin = daemon.pin(NS, step)
        try:
            copies = device_copies(refs, pin.step.files, pin.paths, dst)
            add("raw_h2d", timed(lambda: h2d(dst, pinned)))
            add("mapped_h2d", timed(lambda c=copies: h2d(dst, [sliced(x) for x in c])))
            add("land", timed(lambda c=copies: _device_copy.land(c, pin=True)))
            assert all(torch.equal(x, y) for x, y in zip(dst, src, strict=True)), "land"
        finally:
            daemon.unpin(NS, step, pin.pin_id)
    res = {k: v[1:] for k, v in res.items()}  # the first round maps and registers
    phase_runs = {k: v[1:] for k, v in phase_runs.items()}

    # One more restore, profiled (a new step, as above).
    step += 1
    save(step)
    out: dict[str, Any] = {f"w{i:02d}": torch.empty_like(t) for i, t in enumerate(src)}
    out["extra"] = {"step": -1}
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    dcp.load(out, storage_reader=TieredStorageReader(NS, step, config=cfg), no_dist=True)
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(60)

    med = {k: statistics.median(v) for k, v in res.items()}
    report: dict[str, Any] = {
        "machine": machine_info(device=torch.cuda.get_device_name()),
        "bytes": nbytes,
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "iters_ms": {k: [round(x * 1e3, 3) for x in v] for k, v in res.items()},
        "over_raw_h2d": {k: med["raw_h2d"] / v for k, v in med.items()},
        "phases": {k: summary(v) for k, v in phase_runs.items()},
    }
    for k in res:
        print(f"{k:20s} {med[k] * 1e3:8.2f} ms  {med['raw_h2d'] / med[k]:.2f}x raw H2D")
    for k, v in phase_runs.items():
        print(f"{k} phases: {line(summary(v))}")
    print(text.getvalue())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".prof.txt").write_text(text.getvalue())
    return 0


def h2d(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for x, y in zip(dst, src, strict=True):
        x.view(-1).view(torch.uint8).copy_(y.view(-1).view(torch.uint8), non_blocking=True)


def sliced(c: _device_copy.DeviceCopy) -> torch.Tensor:
    return c.src[c.offset : c.offset + c.target.numel() * c.target.element_size()]


def device_copies(
    refs: Any, files: list[FileRecord], paths: dict[str, str], dst: list[torch.Tensor]
) -> list[_device_copy.DeviceCopy]:
    """The load's copies of tensors ``w00``... into ``dst``: where the metadata says each is."""
    by_fqn = {index.fqn: ref for index, ref in refs.items()}
    records = {f.name: f for f in files}
    copies = []
    for i, t in enumerate(dst):
        ref = by_fqn[f"w{i:02d}"]
        buf = _arena.map_file(paths[ref.file]).buffer
        sums = BlockSums.of(records[ref.file])
        blocks = list(
            range(sums.block_of(ref.offset), sums.block_of(ref.offset + ref.length - 1) + 1)
        )
        copies.append(_device_copy.DeviceCopy(buf, sums, ref.offset, t, blocks))
    return copies


if __name__ == "__main__":
    sys.exit(main())
