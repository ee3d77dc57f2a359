"""The measurements of ``persistent_tier.py``, side by side against one S3 server: (1) upload,
(2) restore after a memory wipe, (3) a training loop's slowdown during an upload; each of
tierckpt, the raw s3torchconnector client and its DCP classes."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _persistent_report import SLOWDOWN_TARGET
from _persistent_setup import (
    BUCKET,
    CHUNK,
    NAMESPACE,
    POLL_S,
    REGION,
    SCRIPT,
    TIER_PREFIX,
    Daemon,
    SeaweedS3,
    raw_source,
)
from harness import (
    MM_SIZE,
    busy_cores,
    check_equal,
    cpu_s,
    make_state,
    mutate,
    steal_cores,
    system_cpu,
    victim,
)

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.layout import marker_key


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
            [
                sys.executable,
                str(SCRIPT),
                "--child-put",
                sizes,
                "--child-endpoint",
                self.s3.endpoint,
            ],
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
