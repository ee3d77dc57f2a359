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
``tier_first_pinned_s``; ``arena_after`` counts the tier files this process has mapped and how many
of them are registered, to show the registration is kept across steps). Targets (issue 15):
tierckpt stall >= 0.9x the raw D2H bandwidth, and at or below torch's best stager.

``--paths`` first measures the device->host copy alone, per destination, from the same 16 CUDA
tensors (:func:`d2h_paths`): pageable memory, a tmpfs file mapped through the client's mapping cache
unregistered and registered (``cudaHostRegister``, timed once), a pinned buffer, ``.to("cpu",
non_blocking=True)`` and torch's reused pinned ``DefaultStager``; for each, how long the copy calls
take to return (an asynchronous copy returns at once) and until the data is there.
Without CUDA the script writes a JSON that says so and exits 0.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import machine_info, write_results
from torch.distributed.checkpoint.staging import AsyncStager

from tierckpt_client import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.launcher import DaemonProcess

N_TENSORS = 16
KEEP_LAST = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-gib", default="1,2,4,8", help="comma-separated GiB")
    p.add_argument("--iters", type=int, default=6, help="saves per contender and size (> 3)")
    p.add_argument("--smoke", action="store_true", help="0.25 GiB, 4 iterations")
    p.add_argument(
        "--paths", action="store_true", help="also time the device->host copy per destination"
    )
    p.add_argument("--no-saves", action="store_true", help="only --paths (no daemon)")
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


def d2h_paths(gib: float, iters: int) -> dict[str, Any]:
    """The device->host copy alone, into each destination, interleaved per iteration."""
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    from tierckpt_client.dcp import _arena

    sd = state(gib)
    src = gpu_tensors(sd)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    shm = Path(tempfile.mkdtemp(prefix="tierckpt-gpu-paths-", dir="/dev/shm"))
    maps = {}
    for name in ("arena_unregistered", "arena_registered"):
        path = shm / name
        with open(path, "wb") as f:
            f.truncate(nbytes)
        maps[name] = _arena.map_file(str(path))
        maps[name].buffer.fill_(0)  # touched, as a recycled tier file is
    t = time.perf_counter()
    ok = _arena.pin(maps["arena_registered"])
    register_s = time.perf_counter() - t
    assert ok and maps["arena_registered"].pinned, "cudaHostRegister failed"

    def views(m: _arena.FileMapping) -> list[torch.Tensor]:
        out, off = [], 0
        for s in src:
            out.append(m.tensor_at(off, s.dtype, s.shape))
            off += s.numel() * s.element_size()
        return out

    dests = {
        "pageable": [torch.empty_like(s, device="cpu").fill_(0) for s in src],
        "arena_unregistered": views(maps["arena_unregistered"]),
        "arena_registered": views(maps["arena_registered"]),
        "pinned_buffer": [torch.empty_like(s, device="cpu").pin_memory() for s in src],
    }
    stager = StateDictStager(pin_memory=True, share_memory=False)
    res: dict[str, dict[str, list[float]]] = {}

    def record(key: str, fn: Any) -> None:
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        r = res.setdefault(key, {"returned_s": [], "done_s": []})
        r["returned_s"].append(t1 - t0)
        r["done_s"].append(t2 - t0)

    for _ in range(iters):
        for key, dst in dests.items():
            record(
                key,
                lambda dst=dst: [
                    d.copy_(s, non_blocking=True) for d, s in zip(dst, src, strict=True)
                ],
            )
        record("to_cpu_non_blocking", lambda: [s.to("cpu", non_blocking=True) for s in src])
        record("torch_stager_pinned", lambda: stager.stage(sd, non_blocking=True))
    for key, dst in dests.items():
        assert all(torch.equal(d, s.cpu()) for d, s in zip(dst, src, strict=True)), f"{key} differs"
    out: dict[str, Any] = {"bytes": nbytes, "register_s": register_s}
    for key, r in res.items():
        steady = r["done_s"][1:] or r["done_s"]
        med = statistics.median(steady)
        out[key] = {
            "median_s": med,
            "best_s": min(steady),
            "gbps": nbytes / med / 1e9,
            "returned_median_s": statistics.median(r["returned_s"][1:] or r["returned_s"]),
            "first_s": r["done_s"][0],
        }
    t = time.perf_counter()
    _arena.clear_cache()  # unregisters the registered file
    out["unregister_s"] = time.perf_counter() - t
    dests.clear()
    shutil.rmtree(shm, ignore_errors=True)
    return out


class PinnedStager(AsyncStager):
    """torch's reused pinned stager as ``DefaultStager(StagingOptions(use_pinned_memory=True,
    use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True))`` runs it: its
    ``StateDictStager`` with pinned memory, then one synchronize. Called directly: torch 2.11's
    ``DefaultStager`` fails on the state ``async_save`` hands it (a KeyError on ``type`` in its
    deepcopy table), which ``dict(state_dict)`` avoids."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager

        self.inner = StateDictStager(pin_memory=True, share_memory=False)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.inner.stage(dict(state_dict), non_blocking=True)
        sync()
        return out

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def arena_counts() -> dict[str, int]:
    from tierckpt_client.dcp import _arena

    with _arena._lock:
        return {
            "mapped": len(_arena._by_base),
            "registered": sum(1 for m in _arena._by_base if m.pinned),
        }


def run_size(gib: float, iters: int, tmp: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemWriter

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
        stager = PinnedStager()
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
        summary: dict[str, Any] = {
            "bytes": nbytes,
            "tier_first_pinned_s": first,
            "arena_after": arena_counts(),
            "iters": res,
        }
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
    if args.paths:
        paths = res["d2h_paths"] = {}
        for gib in args.sizes:
            r = paths[str(gib)] = d2h_paths(gib, args.iters)
            print(
                f"{gib} GiB D2H: register {r['register_s'] * 1e3:.1f} ms, unregister "
                f"{r['unregister_s'] * 1e3:.1f} ms; "
                + ", ".join(
                    f"{k} {v['gbps']:.1f} GB/s (returns in {v['returned_median_s'] * 1e3:.2f} ms)"
                    for k, v in r.items()
                    if isinstance(v, dict)
                ),
                flush=True,
            )
    if args.no_saves:
        write_results(args.out, info, res)
        return
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
                f"{q['tier_restore_h2d_over_raw']:.2f}x raw; arena after {r['arena_after']}",
                flush=True,
            )
    write_results(args.out, info, res)


if __name__ == "__main__":
    main()
