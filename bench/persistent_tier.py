"""Persistent-tier benchmark: tierckpt's S3 upload and restore vs. raw s3torchconnector.

Starts its own SeaweedFS (a real S3 server, loopback, fresh temp dir) and a real daemon with
``TIERCKPT_PERSIST_URL=s3://...``, then measures side by side against that one server
(see bench/README.md):
(1) upload: save returned -> step DURABLE, vs. raw ``S3Client.put_object`` of the same object sizes,
    vs. ``s3torchconnector.dcp.S3StorageWriter``;
(2) restore after wiping the daemon's memory: ``dcp.load`` with ``TieredStorageReader`` (hydrate from
    S3, verify, copy), vs. raw CRT ``get_object`` of the same objects, vs. ``S3StorageReader``;
(3) slowdown of a CPU training loop while the daemon uploads in the background.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _common import add_rates, machine_info, write_results

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.launcher import DaemonProcess
from tierckpt_core.layout import marker_key

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from seaweed import SeaweedS3  # test helper: S3 on loopback

NAMESPACE = "bench"
BUCKET = "tierckpt-bench"
REGION = "us-east-1"
TIER_PREFIX = "tier"
CHUNK = 8 * 1024 * 1024  # tierckpt's streaming chunk and CRT part size; raw uses the same
POLL_S = 0.02
MM_SIZE = 512


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=512, help="tensor bytes of the state dict (MiB)")
    p.add_argument("--tensors", type=int, default=8, help="float32 tensors in the state dict")
    p.add_argument("--iters", type=int, default=3, help="repetitions per measurement (median)")
    p.add_argument("--loop-s", type=float, default=2.5, help="victim training loop length (s)")
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="saves uploaded before the measured ones (default 3 = the daemon's keep_last + 1): "
        "until then the daemon pre-faults spare tier files for the next saves beside the upload, "
        "which a long training run does not see (0 in --smoke)",
    )
    p.add_argument("--no-torch-s3", action="store_true", help="skip s3torchconnector's DCP classes")
    p.add_argument(
        "--server-nice",
        type=int,
        default=19,
        help="niceness of the SeaweedFS process: it stands in for a remote S3 service, so on a "
        "small machine its CPU should not come out of the training loop's share (0: as is)",
    )
    p.add_argument(
        "--restore-only",
        action="store_true",
        help="measure only the restore rows (2): one save and one S3StorageWriter save to read "
        "back, no upload comparison, no training-loop slowdown",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/persistent_tier.json"))
    p.add_argument("--smoke", action="store_true", help="32 MiB, 1 iteration, short loop (CI)")
    p.add_argument("--child-put", help=argparse.SUPPRESS)  # internal: the raw upload baseline
    p.add_argument("--child-endpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_put:
        return args
    if args.smoke:
        args.size_mb, args.iters, args.loop_s, args.warmup = 32, 1, 0.25, 0
    if args.iters < 1:
        p.error("--iters must be at least 1")
    return args


# -- processes ----------------------------------------------------------------------------------


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of a process; ``None`` = this one."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Daemon(DaemonProcess):
    """A daemon persisting to the SeaweedFS bucket, its own tmpfs dir."""

    def __init__(self, s3: SeaweedS3, tag: str) -> None:
        super().__init__(
            Path(f"/dev/shm/tierckpt-bench-s3-{tag}"),
            log_path=Path(tempfile.gettempdir()) / f"tierckpt-bench-s3-{tag}.log",
            extra_env=s3.env(),
            port=0,
            capacity="12G",
            keep_last=2,
            persist_url=f"s3://{BUCKET}/{TIER_PREFIX}",
            persist_keep_last=2,
            log_level="INFO",
        )
        self.concurrency: int | None = None

    def start_with(self, concurrency: int | None = None) -> None:
        """Start with ``concurrency`` upload threads, once the persistent tier answers."""
        self.settings.pop("upload_concurrency", None)
        if concurrency is not None:
            self.settings["upload_concurrency"] = concurrency
        self.concurrency = concurrency
        os.environ["TIERCKPT_SOCKET"] = str(self.socket)
        self.start(ready=_persistent_tier_checked)

    def wipe_restart(self, concurrency: int | None = None) -> None:
        """A rebooted node: the daemon and everything in its memory tier are gone."""
        self.lose_node()
        self.start_with(concurrency)


def _persistent_tier_checked(status: dict[str, Any]) -> bool:
    persistent = status.get("persistent") or {}
    if persistent.get("healthy") is False:
        raise RuntimeError(f"persistent tier unusable: {persistent.get('last_error')}")
    return persistent.get("healthy") is True


# -- state --------------------------------------------------------------------------------------


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


def raw_source(sd: dict[str, torch.Tensor], length: int) -> memoryview:
    """``length`` bytes holding the state's tensor bytes (the same data the tier uploads)."""
    buf = torch.zeros(length, dtype=torch.uint8)
    off = 0
    for t in sd.values():
        b = t.view(torch.uint8)
        n = min(b.numel(), length - off)
        buf[off : off + n] = b[:n]
        off += n
    return memoryview(buf.numpy()).cast("B")


# -- the three contenders ----------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, s3: SeaweedS3, daemon: Daemon) -> None:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

        self.args = args
        self.s3 = s3
        self.daemon = daemon
        self.config = S3ClientConfig(part_size=CHUNK, force_path_style=True)
        self.raw = S3Client(REGION, endpoint=s3.endpoint, s3client_config=self.config)
        # The floor for downloads: the CRT stream of chunks, copied into a pre-touched buffer
        # (S3Client.get_object's sequential reader buffers the whole object in a BytesIO first).
        self.crt = MountpointS3Client(
            region=REGION, part_size=CHUNK, endpoint=s3.endpoint, force_path_style=True
        )
        self.boto = s3.boto3_client()
        self.sd = make_state(args.size_mb, args.tensors)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.sd.values())
        self.step = 0
        self.torch_s3: bool | str = not args.no_torch_s3  # False / True / reason it failed
        self.res: dict[str, Any] = {}

    def _add(self, key: str, seconds: float, nbytes: int, **extra: float) -> None:
        r = self.res.setdefault(key, {"s": [], "bytes": nbytes})
        r["s"].append(seconds)
        for k, v in extra.items():
            r.setdefault(k, []).append(v)

    def _wait_durable(self, client: DaemonClient, step: int) -> None:
        """Until the step is DURABLE. The bench watches for the step's commit marker in the bucket
        first (the daemon writes it last, just before it marks the step durable), so that polling
        costs the bench and the S3 server, not the daemon whose CPU it measures: each status
        request costs the daemon about 3 ms of CPU, which at a 20 ms poll came to a third of the
        upload's measured CPU."""
        deadline = time.monotonic() + 3600
        marker = f"{TIER_PREFIX}/{marker_key(NAMESPACE, step)}"
        while not self._exists(marker):
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step}: no commit marker in the bucket after 1 h")
            time.sleep(POLL_S)
        while client.step(NAMESPACE, step).state != "durable":
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} not durable after 1 h")
            time.sleep(POLL_S)

    def _exists(self, key: str) -> bool:
        try:
            self.boto.head_object(Bucket=BUCKET, Key=key)
        except self.boto.exceptions.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    def _delete_prefix(self, prefix: str) -> None:
        keys = []
        for page in self.boto.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=prefix
        ):
            keys += [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):
            self.boto.delete_objects(Bucket=BUCKET, Delete={"Objects": keys[i : i + 1000]})

    # (1) upload -------------------------------------------------------------------------------

    def tier_save(self) -> tuple[float, int]:
        """Save a new step; return (seconds save returned -> DURABLE, step)."""
        self.step += 1
        step = self.step
        with DaemonClient() as client:
            t0 = time.perf_counter()
            dcp.save(self.sd, storage_writer=TieredStorageWriter(NAMESPACE, step), no_dist=True)
            t1 = time.perf_counter()
            c0, w0 = cpu_s(self.daemon.pid), cpu_s(self.s3_pid)
            self._wait_durable(client, step)
            t2 = time.perf_counter()
            c1, w1 = cpu_s(self.daemon.pid), cpu_s(self.s3_pid)
            info = client.step(NAMESPACE, step)
        self.objects = {
            f"{TIER_PREFIX}/{NAMESPACE}/step_{step:012d}/{f.name}": f.length for f in info.files
        }
        nbytes = sum(self.objects.values())
        self._add("save_tier", t1 - t0, self.nbytes)
        self._add("upload_tier", t2 - t1, nbytes, cpu_uploader=c1 - c0, cpu_server=w1 - w0)
        return t2 - t1, step

    def raw_put(self, it: int) -> None:
        src = raw_source(self.sd, max(self.objects.values()))
        prefix = f"raw/{it}/"
        self._delete_prefix(f"raw/{it - 1}/")
        c0, w0 = cpu_s(), cpu_s(self.s3_pid)
        t0 = time.perf_counter()
        for i, length in enumerate(self.objects.values()):
            with self.raw.put_object(BUCKET, f"{prefix}obj{i}") as w:
                for off in range(0, length, CHUNK):
                    w.write(src[off : min(off + CHUNK, length)])
        dt = time.perf_counter() - t0
        c1, w1 = cpu_s(), cpu_s(self.s3_pid)
        self._add(
            "upload_raw", dt, sum(self.objects.values()), cpu_uploader=c1 - c0, cpu_server=w1 - w0
        )

    def torch_put(self, it: int) -> None:
        if self.torch_s3 is not True:
            return
        from s3torchconnector.dcp import S3StorageWriter

        self._delete_prefix(f"torch/{it - 1}/")
        try:
            writer = S3StorageWriter(REGION, f"s3://{BUCKET}/torch/{it}/", self.config)
            c0, w0 = cpu_s(), cpu_s(self.s3_pid)
            t0 = time.perf_counter()
            dcp.save(self.sd, storage_writer=writer, no_dist=True)
            dt = time.perf_counter() - t0
            c1, w1 = cpu_s(), cpu_s(self.s3_pid)
        except Exception as e:  # optional column: say why, go on
            self.torch_s3 = f"{type(e).__name__}: {e}"[:300]
            print(f"note: s3torchconnector S3StorageWriter skipped: {self.torch_s3}")
            return
        self.torch_dir = f"s3://{BUCKET}/torch/{it}/"
        self._add("upload_torch", dt, self.nbytes, cpu_uploader=c1 - c0, cpu_server=w1 - w0)

    # (2) restore ------------------------------------------------------------------------------

    def tier_load(self, step: int, dest: dict[str, torch.Tensor], direct: bool = True) -> None:
        """Restore after a memory wipe: straight from S3 into ``dest`` (``direct``, the default
        when the trainer knows the persistent tier), or with the daemon hydrating first (today's
        path without ``TIERCKPT_PERSIST_URL`` in the trainer). A direct restore is followed by the
        daemon filling its memory in the background (timed until the step is there) and by a
        second restore, which must come from memory."""
        self.daemon.wipe_restart()
        for t in dest.values():
            t.zero_()
        config = ClientConfig.from_env(restore_direct="on" if direct else "off")
        c0, w0, p0 = cpu_s(self.daemon.pid), cpu_s(self.s3_pid), cpu_s()
        t0 = time.perf_counter()
        reader = TieredStorageReader(NAMESPACE, step, config=config)
        dcp.load(dest, storage_reader=reader, no_dist=True)
        dt = time.perf_counter() - t0
        c1, w1, p1 = cpu_s(self.daemon.pid), cpu_s(self.s3_pid), cpu_s()
        check_equal(dest, self.sd, f"tierckpt step {step} restored from S3")
        nbytes = sum(self.objects.values())
        row = "restore_tier" if direct else "restore_tier_daemon"
        fill = reader.memory_fill
        if direct != (fill is not None):
            raise AssertionError(
                f"{row}: read straight from S3 {fill is not None}, wanted {direct}"
            )
        if fill is None:
            self._add(row, dt, nbytes, cpu_daemon=c1 - c0, cpu_server=w1 - w0, cpu_client=p1 - p0)
            return
        fill.join()
        t_mem = time.perf_counter() - t0
        c2, p2 = cpu_s(self.daemon.pid), cpu_s()
        with DaemonClient(config) as client:
            if not any(c.step == step and c.in_memory for c in client.candidates(NAMESPACE)):
                raise AssertionError(f"step {step} not in memory after the direct restore")
        self._add(
            row,
            dt,
            nbytes,
            cpu_daemon=c1 - c0,
            cpu_server=w1 - w0,
            cpu_client=p1 - p0,
            s_until_in_memory=t_mem,
            cpu_daemon_fill=c2 - c1,
            cpu_client_fill=p2 - p1,
        )
        for t in dest.values():
            t.zero_()
        t0 = time.perf_counter()
        again = TieredStorageReader(NAMESPACE, step, config=config)
        dcp.load(dest, storage_reader=again, no_dist=True)
        dt = time.perf_counter() - t0
        check_equal(dest, self.sd, f"tierckpt step {step} restored again")
        if again.memory_fill is not None:
            raise AssertionError("the restore after the memory fill read S3 again")
        self._add("restore_tier_next", dt, nbytes)

    def raw_get(self, bufs: dict[str, memoryview] | None, row: str) -> None:
        """Into ``bufs`` (pre-touched), or with ``None`` into fresh memory allocated in the timing
        (as a rebooted node must: tierckpt allocates its tier files during the restore)."""
        c0, w0 = cpu_s(), cpu_s(self.s3_pid)
        t0 = time.perf_counter()
        if bufs is None:
            bufs = {k: memoryview(bytearray(n)) for k, n in self.objects.items()}
        for key, out in bufs.items():
            off = 0
            for chunk in self.crt.get_object(BUCKET, key):
                end = off + len(chunk)
                out[off:end] = chunk
                off = end
            if off != len(out):
                raise AssertionError(f"raw get of {key}: {off} bytes, expected {len(out)}")
        dt = time.perf_counter() - t0
        c1, w1 = cpu_s(), cpu_s(self.s3_pid)
        self._add(
            row, dt, sum(len(b) for b in bufs.values()), cpu_client=c1 - c0, cpu_server=w1 - w0
        )

    def torch_load(self, dest: dict[str, torch.Tensor]) -> None:
        if self.torch_s3 is not True:
            return
        from s3torchconnector.dcp import S3StorageReader

        for t in dest.values():
            t.zero_()
        try:
            reader = S3StorageReader(REGION, self.torch_dir, self.config)
            c0, w0 = cpu_s(), cpu_s(self.s3_pid)
            t0 = time.perf_counter()
            dcp.load(dest, storage_reader=reader, no_dist=True)
            dt = time.perf_counter() - t0
            c1, w1 = cpu_s(), cpu_s(self.s3_pid)
        except Exception as e:
            self.torch_s3 = f"S3StorageReader: {type(e).__name__}: {e}"[:300]
            print(f"note: s3torchconnector S3StorageReader skipped: {self.torch_s3}")
            return
        check_equal(dest, self.sd, "S3StorageReader")
        self._add("restore_torch", dt, self.nbytes, cpu_client=c1 - c0, cpu_server=w1 - w0)

    # (3) training slowdown --------------------------------------------------------------------

    def loop_steps(self) -> int:
        a, b = torch.randn(MM_SIZE, MM_SIZE), torch.randn(MM_SIZE, MM_SIZE)
        victim(a, b, 10)
        t0 = time.perf_counter()
        victim(a, b, 40)
        per_step = (time.perf_counter() - t0) / 40
        return max(10, int(self.args.loop_s / per_step))

    def slowdown(self, label: str, steps: int, background: Callable[[], Background]) -> None:
        """Time the loop alone, then right after ``background()`` started an upload."""
        a, b = torch.randn(MM_SIZE, MM_SIZE), torch.randn(MM_SIZE, MM_SIZE)
        for _ in range(self.args.iters):
            mutate(self.sd)
            s0, w0 = system_cpu(), cpu_s(self.s3_pid)
            t0 = time.perf_counter()
            victim(a, b, steps)
            alone = time.perf_counter() - t0
            s1, w1 = system_cpu(), cpu_s(self.s3_pid)
            bg = background()
            s2, c2, w2 = system_cpu(), cpu_s(bg.pid), cpu_s(self.s3_pid)
            t0 = time.perf_counter()
            victim(a, b, steps)
            busy = time.perf_counter() - t0
            s3, c3, w3 = system_cpu(), cpu_s(bg.pid), cpu_s(self.s3_pid)
            covered = bg.running()
            bg.wait()
            r = self.res.setdefault(f"slowdown_{label}", {"steps": steps})
            for k, v in (
                ("alone_s", alone),
                ("busy_s", busy),
                ("covered", covered),
                ("cpu_uploader", c3 - c2),
                ("cpu_server", w3 - w2),
                ("cpu_server_alone", w1 - w0),
                ("system_busy_alone", busy_cores(s0, s1)),
                ("system_busy", busy_cores(s2, s3)),
                ("steal", steal_cores(s2, s3)),
            ):
                r.setdefault(k, []).append(v)

    def tier_background(self) -> Background:
        self.step += 1
        step = self.step
        dcp.save(self.sd, storage_writer=TieredStorageWriter(NAMESPACE, step), no_dist=True)
        client = DaemonClient()

        def wait() -> None:
            self._wait_durable(client, step)
            client.close()

        return Background(
            self.daemon.pid, lambda: client.step(NAMESPACE, step).state != "durable", wait
        )

    def raw_background(self) -> Background:
        """Baseline: the same bytes uploaded by raw put_object in a separate process."""
        sizes = ",".join(str(n) for n in self.objects.values())
        child = subprocess.Popen(
            [sys.executable, __file__, "--child-put", sizes, "--child-endpoint", self.s3.endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert child.stdin is not None and child.stdout is not None
        if child.stdout.readline().strip() != b"ready":
            child.kill()
            raise RuntimeError("the raw upload child did not start")
        child.stdin.write(b"go\n")
        child.stdin.flush()

        def wait() -> None:
            if child.wait(timeout=3600) != 0:
                raise RuntimeError(f"the raw upload child failed with {child.returncode}")

        return Background(child.pid, lambda: child.poll() is None, wait)

    # -- driver ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        assert self.s3.proc is not None
        self.s3_pid = self.s3.proc.pid
        args = self.args
        last_step = 0
        for _ in range(0 if args.restore_only else args.warmup):
            mutate(self.sd)
            self.tier_save()
        self.res.clear()
        for it in range(1 if args.restore_only else args.iters):
            mutate(self.sd)
            _, last_step = self.tier_save()  # first: the others need its object sizes
            if args.restore_only:
                self.torch_put(it)  # what S3StorageReader reads back
                continue
            # the order of the others rotates, so that none always follows the same one
            for fn in (self.raw_put, self.torch_put)[:: 1 if it % 2 == 0 else -1]:
                fn(it)
        dest = {k: torch.zeros_like(v) for k, v in self.sd.items()}
        bufs = {}
        for key, n in self.objects.items():
            b = torch.ones(n, dtype=torch.uint8)  # pre-touched
            bufs[key] = memoryview(b.numpy()).cast("B")
        restores: list[Callable[[], None]] = [
            lambda: self.tier_load(last_step, dest),
            lambda: self.tier_load(last_step, dest, direct=False),
            lambda: self.raw_get(bufs, "restore_raw"),
            lambda: self.raw_get(None, "restore_raw_fresh"),
            lambda: self.torch_load(dest),
        ]
        for it in range(args.iters):
            for fn in restores[it % len(restores) :] + restores[: it % len(restores)]:
                fn()
        bufs.clear()  # free the buffers
        restores.clear()
        if args.restore_only:
            self.res["torch_s3"] = self.torch_s3
            self.res["objects"] = self.objects
            return self.res
        steps = self.loop_steps()
        self.slowdown("tier", steps, self.tier_background)
        self.slowdown("raw", steps, self.raw_background)
        med = statistics.median
        r = self.res["slowdown_tier"]
        if (med(r["busy_s"]) / med(r["alone_s"]) - 1) * 100 > SLOWDOWN_TARGET:
            self.daemon.wipe_restart(concurrency=1)
            self.slowdown("tier_c1", steps, self.tier_background)
        self.res["torch_s3"] = self.torch_s3
        self.res["objects"] = self.objects
        return self.res


class Background:
    """An upload running beside the training loop: its process, running(), wait()."""

    def __init__(self, pid: int, running: Callable[[], bool], wait: Callable[[], None]) -> None:
        self.pid, self.running, self.wait = pid, running, wait


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


def child_put(sizes: str, endpoint: str) -> None:
    """``--child-put``: upload objects of these sizes once the parent says go (slowdown baseline)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    lengths = [int(x) for x in sizes.split(",")]
    client = S3Client(
        REGION,
        endpoint=endpoint,
        s3client_config=S3ClientConfig(part_size=CHUNK, force_path_style=True),
    )
    gen = torch.Generator().manual_seed(1)
    src = memoryview(torch.randn(max(lengths) // 4 + 1, generator=gen).numpy()).cast("B")
    print("ready", flush=True)
    sys.stdin.readline()
    for i, length in enumerate(lengths):
        with client.put_object(BUCKET, f"raw-bg/obj{i}") as w:
            for off in range(0, length, CHUNK):
                w.write(src[off : min(off + CHUNK, length)])


def victim(a: torch.Tensor, b: torch.Tensor, steps: int) -> None:
    """The 'training loop': single-threaded 512x512 matmuls."""
    c = torch.empty_like(a)
    for _ in range(steps):
        torch.mm(a, b, out=c)
        a, c = c.mul_(1e-3), a


# -- report -------------------------------------------------------------------------------------

ROWS = {
    "save_tier": "tierckpt dcp.save into memory (blocking)",
    "upload_tier": "(1) upload: tierckpt, save returned -> DURABLE",
    "upload_raw": "(1) upload: raw S3Client.put_object",
    "upload_torch": "(1) upload: s3torchconnector S3StorageWriter (dcp.save)",
    "restore_tier": "(2) restore: tierckpt dcp.load, memory wiped (S3 straight into the tensors)",
    "restore_tier_daemon": "(2) restore: tierckpt dcp.load, memory wiped, daemon hydrates first",
    "restore_tier_next": "(2) restore: tierckpt dcp.load right after (from memory)",
    "restore_raw": "(2) restore: raw CRT get_object into pre-touched memory",
    "restore_raw_fresh": "(2) restore: raw CRT get_object into fresh memory",
    "restore_torch": "(2) restore: s3torchconnector S3StorageReader (dcp.load)",
}
RATIOS = {  # key: (label, numerator row, denominator row), a ratio of MB/s
    "upload_tier_over_raw": ("tierckpt / raw upload MB/s", "upload_tier", "upload_raw"),
    "restore_tier_over_raw": ("tierckpt / raw restore MB/s", "restore_tier", "restore_raw"),
    "restore_tier_over_raw_fresh": (
        "tierckpt / raw restore into fresh memory MB/s",
        "restore_tier",
        "restore_raw_fresh",
    ),
    "upload_tier_over_torch": (
        "tierckpt / s3torchconnector S3StorageWriter upload MB/s",
        "upload_tier",
        "upload_torch",
    ),
    "restore_tier_over_torch": (
        "tierckpt / s3torchconnector S3StorageReader restore MB/s",
        "restore_tier",
        "restore_torch",
    ),
    "restore_tier_over_tier_daemon": (
        "tierckpt straight from S3 / tierckpt with the daemon hydrating first MB/s",
        "restore_tier",
        "restore_tier_daemon",
    ),
    "restore_tier_daemon_over_raw": (
        "tierckpt with the daemon hydrating first / raw restore MB/s",
        "restore_tier_daemon",
        "restore_raw",
    ),
    "upload_torch_over_raw": ("S3StorageWriter / raw upload MB/s", "upload_torch", "upload_raw"),
    "restore_torch_over_raw": (
        "S3StorageReader / raw restore MB/s",
        "restore_torch",
        "restore_raw",
    ),
}
TARGETS = {  # issue 5: S3 >= 0.9x s3torchconnector, against its raw client and its DCP classes
    "upload_tier_over_raw": 0.9,
    "restore_tier_over_raw": 0.9,
    "upload_tier_over_torch": 0.9,
    "restore_tier_over_torch": 1.2,  # issue 15 goal 2
}
CPU_OF = {  # row: the CPU it measured, from /proc (the daemon's) or the bench's own process
    "upload_tier": "cpu_uploader",
    "upload_raw": "cpu_uploader",
    "upload_torch": "cpu_uploader",
    # restore_tier (straight into the trainer's tensors) is trainer + daemon: restore_cpu_s_per_gb
    "restore_tier_daemon": "cpu_daemon",
    "restore_raw": "cpu_client",
    "restore_raw_fresh": "cpu_client",
    "restore_torch": "cpu_client",
}
CPU_RATIOS = {  # key: (label, numerator row, denominator row), a ratio of CPU-s per GB
    "upload_cpu_tier_over_raw": (
        "tierckpt daemon / raw put_object CPU-s per GB",
        "upload_tier",
        "upload_raw",
    ),
    "restore_cpu_tier_over_raw_fresh": (
        "tierckpt daemon hydrating / raw get_object into fresh memory CPU-s per GB",
        "restore_tier_daemon",
        "restore_raw_fresh",
    ),
}
CPU_TARGETS = {"upload_cpu_tier_over_raw": 1.2}  # issue 15 goal 1: <= 1.2x the raw client's


def upload_figures(res: dict[str, Any]) -> dict[str, Any]:
    """Issue 15 goals 1 and 4 in one place: the upload's MB/s ratios (medians and best
    iterations), CPU-seconds per GB (10^9 bytes) of the daemon uploading and hydrating next to
    the raw clients', targets and met (a ratio of MB/s must reach its target, of CPU not exceed)."""
    per_gb, q, qb = res["cpu_per_gb"], res["ratios"], res["ratios_best"]
    # Hydration: the daemon filling its memory from S3 (the restore row whose daemon hydrates
    # first; the default restore goes straight into the trainer's tensors).
    hydrate = "restore_tier_daemon"
    fig: dict[str, Any] = {
        "upload_tier_over_raw": q.get("upload_tier_over_raw"),
        "upload_tier_over_raw_best": qb.get("upload_tier_over_raw"),
        "upload_tier_over_torch": q.get("upload_tier_over_torch"),
        "upload_tier_over_torch_best": qb.get("upload_tier_over_torch"),
        "upload_cpu_tier_over_raw": res["cpu_ratios"].get("upload_cpu_tier_over_raw"),
    }
    for name, row in (
        ("upload_daemon", "upload_tier"),
        ("upload_raw", "upload_raw"),
        ("upload_torch", "upload_torch"),
        ("hydration_daemon", hydrate),
        ("get_raw_fresh", "restore_raw_fresh"),
        ("get_raw_touched", "restore_raw"),
    ):
        if row in per_gb:
            fig[f"{name}_cpu_s_per_gb"] = per_gb[row]["median"]
            fig[f"{name}_cpu_s_per_gb_best"] = per_gb[row]["best"]
    targets = {
        "upload_tier_over_raw": (">=", 0.9),
        "upload_tier_over_torch": (">=", 0.9),
        "upload_cpu_tier_over_raw": ("<=", 1.2),
    }
    fig["targets"] = {k: f"{op} {t}" for k, (op, t) in targets.items()}
    fig["met"] = {
        k: (fig[k] >= t if op == ">=" else fig[k] <= t)
        for k, (op, t) in targets.items()
        if fig.get(k) is not None
    }
    return fig


SLOWDOWN_TARGET = 10.0
SLOWDOWN_ROWS = {
    "slowdown_tier": "tierckpt daemon (default concurrency)",
    "slowdown_tier_c1": "tierckpt daemon, TIERCKPT_UPLOAD_CONCURRENCY=1",
    "slowdown_raw": "baseline: raw put_object in another process",
}


def summarize(res: dict[str, Any]) -> None:
    med = statistics.median
    add_rates(res, ROWS)
    for key in ROWS:
        if key in res:
            r = res[key]
            for k in (
                "cpu_uploader",
                "cpu_server",
                "cpu_daemon",
                "cpu_client",
                "s_until_in_memory",
                "cpu_daemon_fill",
                "cpu_client_fill",
            ):
                if k in r:
                    r[f"median_{k}"] = med(r[k])
    res["ratios"] = {
        key: res[num]["mbps"] / res[den]["mbps"]
        for key, (_, num, den) in RATIOS.items()
        if num in res and den in res
    }
    # The same ratios from the best iteration of each, and as the median of per-round ratios
    # (the contenders run interleaved, so one round saw about the same load for all of them).
    for key in ROWS:
        if key in res:
            r = res[key]
            r["best_s"] = min(r["s"])
            r["best_mbps"] = r["bytes"] / r["best_s"] / 1e6
    res["ratios_best"] = {
        key: res[num]["best_mbps"] / res[den]["best_mbps"]
        for key, (_, num, den) in RATIOS.items()
        if num in res and den in res
    }
    res["ratios_paired"] = {
        key: med(
            (res[num]["bytes"] / a) / (res[den]["bytes"] / b)
            for a, b in zip(res[num]["s"], res[den]["s"], strict=False)
        )
        for key, (_, num, den) in RATIOS.items()
        if num in res and den in res and key.startswith("restore_")
    }
    # CPU-seconds per GB (10^9 bytes) of each restore, all processes of the contender (tierckpt:
    # the trainer and the daemon; the others: the bench process), robust to a loaded machine.
    cpu_gb: dict[str, float] = {}
    for key in ("restore_tier", "restore_tier_daemon", "restore_raw", "restore_torch"):
        if key in res and "cpu_client" in res[key]:
            r = res[key]
            cpu = med(r["cpu_client"]) + (med(r["cpu_daemon"]) if "cpu_daemon" in r else 0.0)
            cpu_gb[key] = cpu / (r["bytes"] / 1e9)
    res["restore_cpu_s_per_gb"] = cpu_gb
    res["restore_cpu_ratios"] = {
        f"{a}_over_{b.removeprefix('restore_')}": cpu_gb[a] / cpu_gb[b]
        for a, b in (
            ("restore_tier", "restore_raw"),
            ("restore_tier", "restore_torch"),
            ("restore_tier", "restore_tier_daemon"),
            ("restore_tier_daemon", "restore_raw"),
        )
        if a in cpu_gb and b in cpu_gb
    }
    # Cost per GB (10^9 bytes): CPU-seconds of the daemon process (tierckpt) or of the bench's
    # own process around the raw call; never the S3 server's, so it holds where they share cores.
    res["cpu_per_gb"] = {
        key: {
            "median": med(res[key][cpu]) / (res[key]["bytes"] / 1e9),
            "best": min(res[key][cpu]) / (res[key]["bytes"] / 1e9),
            "cpu": cpu,
        }
        for key, cpu in CPU_OF.items()
        if key in res and cpu in res[key]
    }
    per_gb = res["cpu_per_gb"]
    res["cpu_ratios"] = {
        key: per_gb[num]["median"] / per_gb[den]["median"]
        for key, (_, num, den) in CPU_RATIOS.items()
        if num in per_gb and den in per_gb
    }
    res["issue15_upload"] = upload_figures(res)
    for key, r in res.items():
        if key.startswith("slowdown_"):
            r["alone_steps_per_s"] = r["steps"] / med(r["alone_s"])
            r["busy_steps_per_s"] = r["steps"] / med(r["busy_s"])
            r["slowdown_pct"] = (r["alone_steps_per_s"] / r["busy_steps_per_s"] - 1) * 100


def render(res: dict[str, Any]) -> str:
    lines = [
        "| measurement | median s | MB/s | all iterations s | uploader/client CPU s | "
        "server CPU s |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for key, label in ROWS.items():
        if key not in res:
            continue
        r = res[key]
        runs = ", ".join(f"{t:.2f}" for t in r["s"])
        cpu = next(
            (
                r[f"median_{k}"]
                for k in ("cpu_uploader", "cpu_daemon", "cpu_client")
                if f"median_{k}" in r
            ),
            None,
        )
        if "median_cpu_daemon" in r and "median_cpu_client" in r:  # tierckpt: trainer + daemon
            cpu = r["median_cpu_daemon"] + r["median_cpu_client"]
        cpu_txt = f"{cpu:.2f}" if cpu is not None else "-"
        srv = f"{r['median_cpu_server']:.2f}" if "median_cpu_server" in r else "-"
        lines.append(
            f"| {label} | {r['median_s']:.2f} | {r['mbps']:.0f} | {runs} | {cpu_txt} | {srv} |"
        )
    r = res.get("restore_tier", {})
    if "median_s_until_in_memory" in r:
        lines.append(
            f"\nAfter the restore straight from S3, the step was in the daemon's memory "
            f"{r['median_s_until_in_memory']:.2f} s (median) after the restore began (daemon "
            f"{r['median_cpu_daemon_fill']:.2f} CPU-s to fill it; all: "
            f"{', '.join(f'{t:.2f}' for t in r['s_until_in_memory'])})."
        )
    if res.get("torch_s3") is not True:
        lines.append(f"\ns3torchconnector DCP columns skipped: {res.get('torch_s3')}")
    lines += [
        "",
        "| ratio | value (medians) | best iterations | median of rounds | target | met |",
        "|---|---:|---:|---:|---|---|",
    ]
    for key, (label, *_rest) in RATIOS.items():
        if key in res["ratios"]:
            v, best = res["ratios"][key], res["ratios_best"][key]
            t = TARGETS.get(key)
            target = f">= {t}" if t is not None else "(info)"
            met = ("yes" if v >= t else "NO") if t is not None else "-"
            best = res["ratios_best"][key]
            paired = res["ratios_paired"].get(key)
            paired_txt = f"{paired:.2f}" if paired is not None else "-"
            lines.append(f"| {label} | {v:.2f} | {best:.2f} | {paired_txt} | {target} | {met} |")
    if res.get("restore_cpu_s_per_gb"):
        lines += ["", "| restore | CPU-s per GB (trainer + daemon) |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in res["restore_cpu_s_per_gb"].items()]
        lines += [f"| ratio {k} | {v:.2f} |" for k, v in res["restore_cpu_ratios"].items()]
    lines += [
        "",
        "| CPU-s per GB (daemon, or the raw client's process) | median | best |",
        "|---|---:|---:|",
    ]
    for key, v in res["cpu_per_gb"].items():
        lines.append(f"| {ROWS[key]} | {v['median']:.2f} | {v['best']:.2f} |")
    lines += ["", "| CPU ratio | value | target | met |", "|---|---:|---|---|"]
    for key, (label, *_rest) in CPU_RATIOS.items():
        if key in res["cpu_ratios"]:
            v, t = res["cpu_ratios"][key], CPU_TARGETS.get(key)
            target = f"<= {t}" if t is not None else "(info)"
            met = ("yes" if v <= t else "NO") if t is not None else "-"
            lines.append(f"| {label} | {v:.2f} | {target} | {met} |")
    lines += [
        "",
        "| training loop (torch.mm 512x512, 1 thread) while ... uploads | steps | alone steps/s | "
        "during upload steps/s | slowdown % | target | met | upload outlasted loop | uploader "
        "CPU s | server CPU s | cores busy alone / during | steal cores |",
        "|---|---:|---:|---:|---:|---|---|---|---:|---:|---|---:|",
    ]
    med = statistics.median
    for key, label in SLOWDOWN_ROWS.items():
        if key not in res:
            continue
        r = res[key]
        cov = "".join("y" if c else "n" for c in r["covered"])
        target, met = "-", "-"
        if key != "slowdown_raw":
            target = f"<= {SLOWDOWN_TARGET:.0f}"
            met = "yes" if r["slowdown_pct"] <= SLOWDOWN_TARGET else "NO"
        lines.append(
            f"| {label} | {r['steps']} | {r['alone_steps_per_s']:.1f} | "
            f"{r['busy_steps_per_s']:.1f} | {r['slowdown_pct']:.1f} | {target} | {met} | {cov} | "
            f"{med(r['cpu_uploader']):.2f} | {med(r['cpu_server']):.2f} | "
            f"{med(r['system_busy_alone']):.2f} / {med(r['system_busy']):.2f} | "
            f"{med(r['steal']):.2f} |"
        )
    busy_alone = [x for k in SLOWDOWN_ROWS if k in res for x in res[k]["system_busy_alone"]]
    if busy_alone and max(busy_alone) > 1.3:
        lines.append(
            f"\nWARNING: up to {max(busy_alone):.2f} cores were busy while the loop ran alone (it "
            "uses 1): other processes loaded the machine, so these figures are noisy; rerun on an "
            "idle machine."
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.child_put:
        child_put(args.child_put, args.child_endpoint)
        return
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    tag = uuid.uuid4().hex[:8]
    import s3torchconnector

    info = machine_info(
        s3torchconnector=s3torchconnector.__version__,
        size_mb=args.size_mb,
        tensors=args.tensors,
        iters=args.iters,
        loop_s=args.loop_s,
        server_nice=args.server_nice,
    )
    print(
        f"machine: {info['cores']} cores, {info['mem_gib']} GiB, torch {info['torch']}, "
        f"s3torchconnector {info['s3torchconnector']}, python {info['python']}; "
        f"{args.size_mb} MiB in {args.tensors} tensors x {args.iters} iters"
    )
    s3 = SeaweedS3(BUCKET, nice=args.server_nice)
    daemon: Daemon | None = None
    bench: Bench | None = None
    try:
        s3.start()
        print(f"SeaweedFS at {s3.endpoint} (data in {s3.dir}), ready in {s3.startup_s:.2f}s")
        # The bench process's own S3 clients (raw, s3torchconnector DCP) use the same server and
        # credentials; S3StorageWriter/Reader take no endpoint, the CRT reads AWS_ENDPOINT_URL.
        # TIERCKPT_PERSIST_URL: the trainer knows the persistent tier, so a restore of a step in
        # no node's memory reads it straight from S3 (restore_tier_daemon turns that off).
        os.environ.update(
            s3.env(),
            AWS_ENDPOINT_URL=s3.endpoint,
            TIERCKPT_PERSIST_URL=f"s3://{BUCKET}/{TIER_PREFIX}",
        )
        daemon = Daemon(s3, tag)
        daemon.start_with()
        bench = Bench(args, s3, daemon)
        res = bench.run()
    except BaseException:
        if daemon is not None:
            print(f"daemon log (tail):\n{daemon.log()}", file=sys.stderr)
        print(f"SeaweedFS log (tail):\n{s3.log()[-2000:]}", file=sys.stderr)
        raise
    finally:
        if bench is not None:
            bench.boto.close()
        if daemon is not None:
            daemon.cleanup()
        s3.stop()
    summarize(res)
    print(render(res))
    write_results(args.out, info, res)


if __name__ == "__main__":
    main()
