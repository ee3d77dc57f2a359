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
import contextlib
import shutil
import statistics
import tempfile
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _restore_phases import RestorePhases, line, summary
from harness import Row, child_results, machine_info, make_state, start_daemon, write_results, yes
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from tierckpt_client import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _device_copy

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
    p.add_argument(
        "--restore-only",
        action="store_true",
        help="only the restore and the asynchronous staging (with raw H2D and D2H), no torch "
        "contenders nor synchronous or unpinned saves: a short run",
    )
    p.add_argument(
        "--verify-threads",
        default="0",
        help="comma-separated threads checking a restore's blocks (0: torch's intra-op "
        "threads, the default); each other count is one more contender, tier_restore_t<N>",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_staging.json"))
    args = p.parse_args()
    if args.smoke:
        args.sizes_gib, args.iters = "0.25", 4
    args.sizes = [float(s) for s in args.sizes_gib.split(",")]
    args.verify = [int(t) for t in args.verify_threads.split(",")]
    return args


def sync() -> None:
    torch.cuda.synchronize()


def state(gib: float) -> dict[str, Any]:
    return make_state(gib * 1024, N_TENSORS, extra={"step": 0}, device="cuda")


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


class TorchAsyncStager(AsyncStager):
    """What ``DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
    use_async_staging=True, use_non_blocking_copy=True))`` runs, line for line (one executor
    thread, a staging stream made here, its ``StateDictStager`` with pinned memory under that
    stream, then the stream synchronized): used only where the real one fails on this torch
    (torch 2.11's deepcopy table, see :class:`PinnedStager`); which one ran is in the JSON."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from torch.distributed.checkpoint._state_dict_stager import StateDictStager

        self.inner = StateDictStager(pin_memory=True, share_memory=False)
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.stream = torch.cuda.Stream()

    def _stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        with torch.cuda.stream(self.stream):
            out: dict[str, Any] = self.inner.stage(dict(state_dict), non_blocking=True)
        self.stream.synchronize()
        return out

    def stage(self, state_dict: dict[str, Any]) -> Future[dict[str, Any]]:
        return self.pool.submit(self._stage, state_dict)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def torch_async_stager() -> AsyncStager:
    """torch's own asynchronous stager, as torchtitan's zero-overhead mode makes it (less the
    shared memory, which only DCP's helper process needs)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=True,
        )
    )


def staged_at(res: Any, t0: float) -> tuple[float, list[float]]:
    """The stall (``async_save`` returned) and a cell that gets the time until staged."""
    stall = time.perf_counter() - t0
    done: list[float] = []
    if isinstance(res, AsyncSaveResponse):
        res.staging_completion.add_done_callback(lambda _: done.append(time.perf_counter() - t0))
    else:
        done.append(stall)
    return stall, done


def run_size(
    gib: float,
    iters: int,
    tmp: Path,
    *,
    phases: RestorePhases,
    restore_only: bool = False,
    verify_threads: tuple[int, ...] = (0,),
) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemWriter

    shm = Path(tempfile.mkdtemp(prefix="tierckpt-gpu-", dir="/dev/shm"))
    # torch's files: in memory too where it has room (its upload is not measured, only waited for)
    room = shutil.disk_usage("/dev/shm").free > (KEEP_LAST + 5) * gib * (1 << 30)
    fs = Path(tempfile.mkdtemp(prefix="tierckpt-gpu-torch-", dir="/dev/shm" if room else tmp))
    capacity = int((KEEP_LAST + 2) * gib * 1024) + 1024
    log = tmp / f"daemon-{gib}.log"
    d = start_daemon(capacity, keep_last=KEEP_LAST, shm_dir=shm, log_path=log, set_env=False)
    try:
        sd = state(gib)
        nbytes = sum(t.numel() * t.element_size() for t in gpu_tensors(sd))
        pinned = [torch.empty_like(t, device="cpu").pin_memory() for t in gpu_tensors(sd)]
        cfg = ClientConfig.from_env(socket=d.socket)
        unpinned_cfg = ClientConfig.from_env(socket=d.socket, pin_memory=False)
        stager = PinnedStager()
        async_stager: AsyncStager = torch_async_stager()
        async_kind = "DefaultStager"
        keys = (
            "raw_d2h",
            "torch_stall",
            "tier_stall",
            "tier_stall_unpinned",
            "tier_async_stall",
            "tier_async_staged",
            "torch_async_stall",
            "torch_async_staged",
            "raw_h2d",
        )
        restores = {t: "tier_restore" if not t else f"tier_restore_t{t}" for t in verify_threads}
        keys += tuple(restores.values())
        res: dict[str, list[float]] = {k: [] for k in keys}
        phase_runs: dict[str, list[dict[str, float]]] = {k: [] for k in restores.values()}
        step = 0

        def tier_save(config: ClientConfig, *, asynchronous: bool = False) -> tuple[float, float]:
            nonlocal step
            step += 1
            sd["extra"]["step"] = step
            writer = TieredStorageWriter("gpu", step, config=config, async_staging=asynchronous)
            sync()
            t = time.perf_counter()
            out = dcp.async_save(sd, storage_writer=writer, no_dist=True)
            stall, done = staged_at(out, t)
            if isinstance(out, AsyncSaveResponse):
                out.staging_completion.result()
                out.upload_completion.result()
            else:
                out.result()
            return stall, done[0]

        def torch_save(i: int, st: AsyncStager) -> tuple[float, float]:
            writer = FileSystemWriter(str(fs / f"torch-{i % 2}"))  # made before the clock, as ours
            sync()
            t = time.perf_counter()
            out = dcp.async_save(sd, storage_writer=writer, async_stager=st, no_dist=True)
            stall, done = staged_at(out, t)
            if isinstance(out, AsyncSaveResponse):
                out.staging_completion.result()
                out.upload_completion.result()
            else:
                out.result()
            return stall, done[0]

        def raw_d2h() -> None:
            for dst, src in zip(pinned, gpu_tensors(sd), strict=True):
                dst.copy_(src, non_blocking=True)

        def raw_h2d() -> None:
            for dst, src in zip(gpu_tensors(sd), pinned, strict=True):
                dst.copy_(src, non_blocking=True)

        for _ in range(0 if restore_only else iters):  # unpinned first: a pinned file stays pinned
            res["tier_stall_unpinned"].append(tier_save(unpinned_cfg)[0])
        first: list[float] = []
        for _ in range(KEEP_LAST + 1):  # each recycled tier file is registered once
            first.append(tier_save(cfg)[0])

        def torch_async(i: int) -> tuple[float, float]:
            """A save with torch's asynchronous stager; where it fails on this torch (2.11's
            deepcopy table, on the first or a reused stage), its replica from then on."""
            nonlocal async_stager, async_kind
            try:
                return torch_save(i, async_stager)
            except Exception as e:
                if async_kind == "replica":
                    raise
                print(f"torch's DefaultStager failed ({type(e).__name__}: {e}); its replica runs")
                with contextlib.suppress(Exception):
                    async_stager.close()
                async_stager, async_kind = TorchAsyncStager(), "replica"
                return torch_save(i, async_stager)

        if not restore_only:
            torch_async(0)  # torch's first asynchronous save allocates its pinned buffers
            torch_async(1)  # and its first reuse of them
        try:  # the asynchronous stage once before the clock; a torch without it: rows left out
            tier_save(cfg, asynchronous=True)
            tier_async = True
        except Exception:
            tier_async = False
            print(f"tierckpt's asynchronous stage failed here:\n{traceback.format_exc()}")
        for i in range(iters):
            res["raw_d2h"].append(timed(raw_d2h))
            if not restore_only:
                res["tier_stall"].append(tier_save(cfg)[0])
                res["torch_stall"].append(torch_save(i, stager)[0])
            if tier_async:
                stall, staged = tier_save(cfg, asynchronous=True)
                res["tier_async_stall"].append(stall)
                res["tier_async_staged"].append(staged)
            if not restore_only:
                stall, staged = torch_async(i)
                res["torch_async_stall"].append(stall)
                res["torch_async_staged"].append(staged)
            res["raw_h2d"].append(timed(raw_h2d))
            for threads, key in restores.items():  # each a step not loaded before, as a resume
                if threads and key != "tier_restore":
                    tier_save(cfg)
                _device_copy.VERIFY_THREADS = threads or None
                out = {k: torch.empty_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
                out["extra"] = {"step": -1}

                def load(out: dict[str, Any] = out, key: str = key) -> None:
                    with phases.measure() as ph:
                        dcp.load(
                            out,
                            storage_reader=TieredStorageReader("gpu", step, config=cfg),
                            no_dist=True,
                        )
                    phase_runs[key].append(ph)

                try:
                    res[key].append(timed(load))
                finally:
                    _device_copy.VERIFY_THREADS = None
                assert all(torch.equal(out[k], sd[k]) for k in out if k != "extra"), (
                    "restore differs"
                )
                assert out["extra"]["step"] == step
        stager.close()
        async_stager.close()
        summary_: dict[str, Any] = {
            "bytes": nbytes,
            "torch_async_stager": "not run" if restore_only else async_kind,
            "tier_first_pinned_s": first,
            "arena_after": arena_counts(),
            "iters": res,
        }
        for key, runs in phase_runs.items():
            summary_[f"{key}_phases"] = summary(runs)
        for k, v in res.items():
            if v:
                med = statistics.median(v)
                summary_[k] = {"median_s": med, "best_s": min(v), "gbps": nbytes / med / 1e9}

        def m(key: str) -> float:
            return float(summary_[key]["median_s"]) if key in summary_ else float("nan")

        summary_["ratios"] = {
            "tier_d2h_over_raw": m("raw_d2h") / m("tier_stall"),
            "tier_over_torch_stall": m("tier_stall") / m("torch_stall"),
            "unpinned_over_pinned_stall": m("tier_stall_unpinned") / m("tier_stall"),
            "tier_async_over_torch_async_stall": m("tier_async_stall") / m("torch_async_stall"),
            "tier_async_staged_over_raw_d2h": m("tier_async_staged") / m("raw_d2h"),
            "torch_async_staged_over_raw_d2h": m("torch_async_staged") / m("raw_d2h"),
            "tier_restore_h2d_over_raw": m("raw_h2d") / m("tier_restore"),
            **{
                f"{key}_h2d_over_raw": m("raw_h2d") / m(key)
                for key in restores.values()
                if key != "tier_restore"
            },
        }
        return summary_
    finally:
        d.cleanup()
        shutil.rmtree(fs, ignore_errors=True)


def markdown(res: dict[str, Any]) -> str:
    """The table docs/benchmarks.md takes (medians, ms; targets of issue 36)."""
    lines = [
        "| | "
        + " | ".join(
            f"{float(s) * 1024:g} MiB" if float(s) < 1 else f"{float(s):g} GiB" for s in res
        )
        + " |",
        "|---|" + "---:|" * len(res),
    ]

    def row(name: str, fn: Any) -> None:
        lines.append(f"| {name} | " + " | ".join(fn(r) for r in res.values()) + " |")

    def ms(key: str) -> Any:
        return lambda r: f"{r[key]['median_s'] * 1e3:.2f}" if key in r else "-"

    row("raw D2H into a pinned buffer (ms)", ms("raw_d2h"))
    row("tierckpt stall, synchronous stage (ms)", ms("tier_stall"))
    row("torch stall, reused pinned stager, synchronous (ms)", ms("torch_stall"))
    row("**tierckpt stall, asynchronous stage** (ms)", ms("tier_async_stall"))
    row("torch stall, `DefaultStager` asynchronous (ms)", ms("torch_async_stall"))
    row(
        "tierckpt async / torch async stall (target <= 1)",
        lambda r: f"{r['ratios']['tier_async_over_torch_async_stall']:.2f}",
    )
    row("**tierckpt time until staged** (ms)", ms("tier_async_staged"))
    row("torch time until staged (ms)", ms("torch_async_staged"))
    row(
        "tierckpt staged / raw D2H (target <= 1.1)",
        lambda r: f"{r['ratios']['tier_async_staged_over_raw_d2h']:.2f}",
    )
    row("raw pinned H2D (ms)", ms("raw_h2d"))
    row("**tierckpt restore into CUDA tensors, verified** (ms)", ms("tier_restore"))
    row(
        "restore / raw H2D as rates (target >= 0.8)",
        lambda r: f"{r['ratios']['tier_restore_h2d_over_raw']:.2f}",
    )
    row("torch's asynchronous stager", lambda r: str(r["torch_async_stager"]))
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """The suite's run, where CUDA is available."""
    if not torch.cuda.is_available():
        notes.append("GPU staging not measured: no CUDA device on this machine")
        return None
    cmd = ["--smoke"] if args.smoke else []
    what = "GPU staging (pinned tier file)"
    d = child_results("gpu_staging.py", cmd, tmp / "gpu_staging.json", what, notes, "GPU staging")
    return None if d is None else dict(d["results"])


def rows(res: dict[str, Any]) -> list[Row]:
    """Per size: the stall's D2H against a raw one and torch's stagers, the restore's H2D."""
    g = res.get("gpu_staging") or {}
    out: list[Row] = []
    for size, r in g.items():
        q = r["ratios"]
        gib = f"{float(size):g} GiB"

        def ms(key: str, r: dict[str, Any] = r) -> str:
            return f"{r[key]['median_s'] * 1e3:.0f} ms"

        out.append((gib, "GPU: raw D2H into pinned memory", ms("raw_d2h"), "", "", "", ""))
        out.append(
            (
                gib,
                "GPU: tierckpt stall, D2H into the pinned tier file",
                ms("tier_stall"),
                f"{r['tier_stall']['gbps']:.1f}",
                f"{q['tier_d2h_over_raw']:.2f}x raw D2H GB/s; "
                f"{q['tier_over_torch_stall']:.2f}x torch's reused pinned stager",
                ">= 0.9; <= 1",
                f"{yes(q['tier_d2h_over_raw'] >= 0.9)}; {yes(q['tier_over_torch_stall'] <= 1)}",
            )
        )
        if "tier_async_stall" in r:
            out.append(
                (
                    gib,
                    "GPU: tierckpt stall with asynchronous staging",
                    ms("tier_async_stall"),
                    "",
                    f"{q['tier_async_over_torch_async_stall']:.2f}x torch's asynchronous "
                    f"DefaultStager; staged after {ms('tier_async_staged')} "
                    f"({q['tier_async_staged_over_raw_d2h']:.2f}x raw D2H)",
                    "<= 1; <= 1.1",
                    f"{yes(q['tier_async_over_torch_async_stall'] <= 1)}; "
                    f"{yes(q['tier_async_staged_over_raw_d2h'] <= 1.1)}",
                )
            )
        out.append(
            (
                gib,
                "GPU: tierckpt restore into CUDA tensors",
                ms("tier_restore"),
                f"{r['tier_restore']['gbps']:.1f}",
                f"{q['tier_restore_h2d_over_raw']:.2f}x raw H2D GB/s",
                ">= 0.8",
                yes(q["tier_restore_h2d_over_raw"] >= 0.8),
            )
        )
    return out


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
    failed: dict[str, str] = {}
    phases = RestorePhases().install()
    with tempfile.TemporaryDirectory(prefix="tierckpt-gpu-bench-") as tmp:
        for gib in args.sizes:
            try:
                r = run_size(
                    gib,
                    args.iters,
                    Path(tmp),
                    phases=phases,
                    restore_only=args.restore_only,
                    verify_threads=tuple(args.verify),
                )
            except Exception:  # the next sizes still run; the JSON says what failed
                failed[str(gib)] = traceback.format_exc()
                print(f"{gib} GiB failed:\n{failed[str(gib)]}", flush=True)
                res["failed"] = failed
                write_results(args.out, info, res)
                continue
            res[str(gib)] = r
            write_results(args.out, info, res)  # each size as it is done
            q, nan = r["ratios"], float("nan")
            print(
                f"{gib} GiB: raw D2H {r['raw_d2h']['gbps']:.1f} GB/s, tierckpt stall "
                f"{r.get('tier_stall', {}).get('median_s', nan) * 1e3:.0f} ms "
                f"({q['tier_d2h_over_raw']:.2f}x raw; target >= 0.9), torch best stager "
                f"{r.get('torch_stall', {}).get('median_s', nan) * 1e3:.0f} ms "
                f"(tierckpt/torch {q['tier_over_torch_stall']:.2f}; target <= 1), unpinned "
                f"{q['unpinned_over_pinned_stall']:.1f}x slower, first pinned saves "
                f"{', '.join(f'{s:.2f}' for s in r['tier_first_pinned_s'])} s; asynchronous: "
                f"stall {r.get('tier_async_stall', {}).get('median_s', nan) * 1e3:.2f} ms "
                f"({q['tier_async_over_torch_async_stall']:.2f}x torch's; target <= 1), staged "
                f"{q['tier_async_staged_over_raw_d2h']:.2f}x raw D2H (target <= 1.1); restore "
                f"H2D {q['tier_restore_h2d_over_raw']:.2f}x raw (target >= 0.8); arena after "
                f"{r['arena_after']}",
                flush=True,
            )
            for key in sorted(k for k in r if k.endswith("_phases")):
                ratio = q.get(key.replace("_phases", "_h2d_over_raw"), float("nan"))
                print(f"{gib} GiB {key} ({ratio:.2f}x raw H2D): {line(r[key])}", flush=True)
    write_results(args.out, info, res)
    sizes = {k: v for k, v in res.items() if k not in ("d2h_paths", "failed")}
    if sizes:
        table = markdown(sizes)
        print(table)
        args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
