"""GPU staging: device->host into the tier file registered as pinned memory, and host->device restore.

For each size (GiB), interleaved per iteration, from a CUDA state dict of 16 float32 tensors:

- ``raw_d2h``: one ``copy_(non_blocking=True)`` per tensor into a pinned host buffer allocated
  once, then a synchronize: the link's device->host floor;
- ``torch_stall``: ``async_save`` with one reused ``DefaultStager`` (pinned memory, synchronous
  staging so the call returns when it is safe to change the parameters) and a FileSystemWriter;
- ``tier_stall``: ``async_save`` with ``TieredStorageWriter`` into the daemon's tier file, pinned
  with ``cudaHostRegister`` (``TIERCKPT_PIN_MEMORY``, on by default);
- ``tier_stall_unpinned``: the same with ``pin_memory=False``, run before the pinned saves;
- ``raw_h2d`` and ``tier_restore``: a copy back from a pinned buffer, and ``dcp.load`` through the
  daemon into the CUDA tensors (verified), checked bit-exact.

The first pinned save of each recycled tier file pays its registration (reported apart, as
``tier_first_pinned_s``). Targets (issue 15): tierckpt stall >= 0.9x the raw D2H bandwidth, and at or
below torch's best stager. Without CUDA the script writes a JSON that says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import machine_info, write_results

from tierckpt_client import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_daemon.launcher import DaemonProcess

N_TENSORS = 16
KEEP_LAST = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-gib", default="1,2,4,8", help="comma-separated GiB")
    p.add_argument("--iters", type=int, default=6, help="saves per contender and size (> 3)")
    p.add_argument("--smoke", action="store_true", help="0.25 GiB, 4 iterations")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_staging.json"))
    args = p.parse_args()
    if args.smoke:
        args.sizes_gib, args.iters = "0.25", 4
    args.sizes = [float(s) for s in args.sizes_gib.split(",")]
    return args


def sync() -> None:
    torch.cuda.synchronize()


def state(gib: float) -> dict[str, Any]:
    numel = int(gib * (1 << 30)) // N_TENSORS // 4
    g = torch.Generator(device="cuda").manual_seed(0)
    sd: dict[str, Any] = {
        f"w{i:02d}": torch.randn(numel, device="cuda", generator=g) for i in range(N_TENSORS)
    }
    sd["extra"] = {"step": 0}
    return sd


def gpu_tensors(sd: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in sd.values() if isinstance(v, torch.Tensor)]


def timed(fn: Any) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def run_size(gib: float, iters: int, tmp: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    shm = Path(tempfile.mkdtemp(prefix="tierckpt-gpu-", dir="/dev/shm"))
    d = DaemonProcess(
        shm,
        log_path=tmp / f"daemon-{gib}.log",
        capacity=f"{int((KEEP_LAST + 2) * gib * 1024) + 1024}M",
        keep_last=KEEP_LAST,
        log_level="WARNING",
    ).start()
    try:
        sd = state(gib)
        nbytes = sum(t.numel() * t.element_size() for t in gpu_tensors(sd))
        pinned = [torch.empty_like(t, device="cpu").pin_memory() for t in gpu_tensors(sd)]
        cfg = ClientConfig.from_env(socket=d.socket)
        unpinned_cfg = ClientConfig.from_env(socket=d.socket, pin_memory=False)
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=True,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=True,
            )
        )
        res: dict[str, list[float]] = {
            k: []
            for k in (
                "raw_d2h",
                "torch_stall",
                "tier_stall",
                "tier_stall_unpinned",
                "raw_h2d",
                "tier_restore",
            )
        }
        step = 0

        def tier_save(config: ClientConfig) -> float:
            nonlocal step
            step += 1
            sd["extra"]["step"] = step
            t = time.perf_counter()
            fut = dcp.async_save(
                sd, storage_writer=TieredStorageWriter("gpu", step, config=config), no_dist=True
            )
            stall = time.perf_counter() - t
            fut.result()
            return stall

        def raw_d2h() -> None:
            for dst, src in zip(pinned, gpu_tensors(sd), strict=True):
                dst.copy_(src, non_blocking=True)

        def raw_h2d() -> None:
            for dst, src in zip(gpu_tensors(sd), pinned, strict=True):
                dst.copy_(src, non_blocking=True)

        for _ in range(iters):  # unpinned first: a pinned file stays pinned for the process
            res["tier_stall_unpinned"].append(tier_save(unpinned_cfg))
        first: list[float] = []
        for _ in range(KEEP_LAST + 1):  # each recycled tier file is registered once
            first.append(tier_save(cfg))
        for i in range(iters):
            res["raw_d2h"].append(timed(raw_d2h))
            res["tier_stall"].append(tier_save(cfg))
            t = time.perf_counter()
            fut = dcp.async_save(
                sd,
                storage_writer=FileSystemWriter(str(tmp / f"torch-{gib}-{i % 2}")),
                async_stager=stager,
                no_dist=True,
            )
            res["torch_stall"].append(time.perf_counter() - t)
            fut.result()
            res["raw_h2d"].append(timed(raw_h2d))
            out = {k: torch.empty_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
            out["extra"] = {"step": -1}
            res["tier_restore"].append(
                timed(
                    lambda out=out: dcp.load(  # type: ignore[misc]
                        out,
                        storage_reader=TieredStorageReader("gpu", step, config=cfg),
                        no_dist=True,
                    )
                )
            )
            assert all(torch.equal(out[k], sd[k]) for k in out if k != "extra"), "restore differs"
        stager.close()
        summary: dict[str, Any] = {"bytes": nbytes, "tier_first_pinned_s": first, "iters": res}
        for k, v in res.items():
            med = statistics.median(v)
            summary[k] = {"median_s": med, "best_s": min(v), "gbps": nbytes / med / 1e9}
        raw = summary["raw_d2h"]["median_s"]
        summary["ratios"] = {
            "tier_d2h_over_raw": raw / summary["tier_stall"]["median_s"],
            "tier_over_torch_stall": summary["tier_stall"]["median_s"]
            / summary["torch_stall"]["median_s"],
            "unpinned_over_pinned_stall": summary["tier_stall_unpinned"]["median_s"]
            / summary["tier_stall"]["median_s"],
            "tier_restore_h2d_over_raw": summary["raw_h2d"]["median_s"]
            / summary["tier_restore"]["median_s"],
        }
        return summary
    finally:
        d.cleanup()


def main() -> None:
    args = parse_args()
    info = machine_info(sizes_gib=args.sizes, iters=args.iters)
    if not torch.cuda.is_available():
        print("gpu_staging: no CUDA device here; nothing measured")
        write_results(args.out, info, {"skipped": "no CUDA device"})
        return
    info["gpu"] = torch.cuda.get_device_name()
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tierckpt-gpu-bench-") as tmp:
        for gib in args.sizes:
            r = run_size(gib, args.iters, Path(tmp))
            res[str(gib)] = r
            q = r["ratios"]
            print(
                f"{gib} GiB: raw D2H {r['raw_d2h']['gbps']:.1f} GB/s, tierckpt stall "
                f"{r['tier_stall']['median_s'] * 1e3:.0f} ms ({q['tier_d2h_over_raw']:.2f}x raw; "
                f"target >= 0.9), torch best stager {r['torch_stall']['median_s'] * 1e3:.0f} ms "
                f"(tierckpt/torch {q['tier_over_torch_stall']:.2f}; target <= 1), unpinned "
                f"{q['unpinned_over_pinned_stall']:.1f}x slower, first pinned saves "
                f"{', '.join(f'{s:.2f}' for s in r['tier_first_pinned_s'])} s; restore H2D "
                f"{q['tier_restore_h2d_over_raw']:.2f}x raw",
                flush=True,
            )
    write_results(args.out, info, res)


if __name__ == "__main__":
    main()
