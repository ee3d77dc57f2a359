"""The contenders of ``peers.py`` (issue 35), each used the way its documentation shows (their
list and what each figure means: ``peers.py``'s docstring and docs/benchmarks.md, "Beside the
peers"), and one round of the benchmark (:func:`one_round`), shared by one process and by
``--ranks`` > 1 (``_peers_ranks.py``). A contender has ``name``, ``save(sd, step) -> (stall,
done)`` in seconds, ``restore(dst, verified) -> seconds`` and ``close()``; built in one process
it uses DCP's ``no_dist``, in a rank the default process group."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import check_equal, start_daemon
from stall import _ReusedStager
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client.checkpointer import Checkpointer
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.launcher import DaemonProcess

KEEP_LAST = 2
ORDER = ("tierckpt", "tierckpt_ckpt", "torch", "dlrover", "gemini")
THREAD = AsyncCheckpointerType.THREAD


def copy_into(dst: dict[str, torch.Tensor], src: dict[str, Any]) -> None:
    for k, d in dst.items():
        d.copy_(src[k])


def dist_kw() -> dict[str, Any]:
    """DCP's process-group keyword here: ``no_dist`` in one process, the default group (the
    real plan and commit across ranks) under ``--ranks`` > 1."""
    return {} if dist.is_initialized() else {"no_dist": True}


class Tierckpt:
    """``async_save`` through a real daemon; restores verified and unverified. ``socket``: the
    node's daemon for this contender, started by the parent (:meth:`serve`) with several ranks;
    without it the contender starts its own."""

    name = "tierckpt"
    namespace = "peers"

    def __init__(self, root: Path, size_mb: int, socket: str | None = None) -> None:
        self.daemon = None if socket else self.serve(root, size_mb)
        sock = Path(socket) if socket else self.daemon.socket  # type: ignore[union-attr]
        self.on = ClientConfig.from_env(socket=sock)
        self.off = ClientConfig.from_env(socket=sock, verify_reads=False)
        self.step = 0

    @classmethod
    def serve(cls, root: Path, size_mb: int) -> DaemonProcess:
        """This contender's daemon on its own tmpfs dir under ``root`` (``size_mb``: all ranks')."""
        capacity = (KEEP_LAST + 2) * size_mb + 256
        own = root / cls.name
        return start_daemon(
            capacity,
            keep_last=KEEP_LAST,
            shm_dir=own / "tier",
            log_path=own / "daemon.log",
            set_env=False,
        )

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        self.step = step
        writer = TieredStorageWriter(self.namespace, step=step, config=self.on)
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=THREAD, **dist_kw())
        stall = time.perf_counter() - t0
        fut.result()
        return stall, time.perf_counter() - t0

    def restore(self, dst: dict[str, torch.Tensor], verified: bool = True) -> float:
        reader = TieredStorageReader(
            self.namespace, step=self.step, config=self.on if verified else self.off
        )
        t0 = time.perf_counter()
        dcp.load(dst, storage_reader=reader, **dist_kw())
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop(timeout=10)


class TierckptCheckpointer(Tierckpt):
    """``Checkpointer.save`` (THREAD, staged synchronously) through a real daemon of its own;
    restored by ``Checkpointer.restore`` (the newest step, verified), as its users resume."""

    name = "tierckpt_ckpt"
    namespace = "peers-ckpt"

    def __init__(self, root: Path, size_mb: int, socket: str | None = None) -> None:
        super().__init__(root, size_mb, socket)
        self.ckpt = Checkpointer(
            self.namespace, async_staging=False, handle_signals=False, config=self.on
        )

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        self.step = step
        t0 = time.perf_counter()
        self.ckpt.save(step, sd)
        stall = time.perf_counter() - t0
        self.ckpt.wait()
        return stall, time.perf_counter() - t0

    def restore(self, dst: dict[str, torch.Tensor], verified: bool = True) -> float:
        t0 = time.perf_counter()
        step = self.ckpt.restore(dst)  # "latest", as a resume does
        took = time.perf_counter() - t0
        if step != self.step:
            raise RuntimeError(f"{self.name}: restored step {step}, saved {self.step}")
        return took

    def close(self) -> None:
        try:
            self.ckpt.close()
        finally:
            super().close()


class TorchBest:
    """torch DCP with one reused ``DefaultStager`` into /dev/shm files."""

    name = "torch"

    def __init__(self, root: Path, size_mb: int) -> None:
        self.root = root / "torch"
        self.stager = _ReusedStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self.path: Path | None = None

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        old, self.path = self.path, self.root / f"step_{step}"
        t0 = time.perf_counter()
        fut = dcp.async_save(
            sd,
            storage_writer=FileSystemWriter(self.path),
            async_stager=self.stager,
            async_checkpointer_type=THREAD,
            **dist_kw(),
        )
        stall = time.perf_counter() - t0
        fut.result()
        done = time.perf_counter() - t0
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return stall, done

    def restore(self, dst: dict[str, torch.Tensor], verified: bool = True) -> float:
        assert self.path is not None
        t0 = time.perf_counter()
        dcp.load(dst, storage_reader=FileSystemReader(self.path), **dist_kw())
        return time.perf_counter() - t0

    def close(self) -> None:
        self.stager.close()


class DLRover:
    """DLRover Flash Checkpoint's memory save (synchronous copy into its shm segment). With
    several ranks each holds a shard: ``local_shard_num`` = ``global_shard_num`` = the ranks (its
    docstring's setting for a state partitioned on all ranks), one segment per rank."""

    name = "dlrover"

    def __init__(self, root: Path, size_mb: int) -> None:
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        self.memory = StorageType.MEMORY
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        # Its shared-memory segment (one per local shard, named after TORCHELASTIC_RUN_ID where
        # set), which it leaves behind on exit.
        run = os.environ.get("TORCHELASTIC_RUN_ID")
        self.shm = Path("/dev/shm") / f"{run + '_' if run else ''}ckpt_shm_{rank}"
        if self.shm.exists():
            raise RuntimeError(f"dlrover: {self.shm} exists (another DLRover job on this host?)")
        self.ckpt = DdpCheckpointer(
            str(root / "dlrover"), local_shard_num=ranks, global_shard_num=ranks
        )
        # Its saver process: forked here by local rank 0 (no dlrover-run), None elsewhere.
        self.saver = getattr(self.ckpt._engine, "saver_proc", None)

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.ckpt.save_checkpoint(step, sd, storage_type=self.memory)
        stall = time.perf_counter() - t0
        return stall, stall

    def restore(self, dst: dict[str, torch.Tensor], verified: bool = True) -> float:
        t0 = time.perf_counter()
        copy_into(dst, self.ckpt.load_checkpoint())
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ckpt._engine.close()
        if self.saver is not None and self.saver.is_alive():
            self.saver.terminate()
            self.saver.join(timeout=10)
        self.shm.unlink(missing_ok=True)


class Gemini:
    """LM Resiliency's ``InMemoryCheckpointManager`` (GEMINI). One rank: no peer replica. With
    several, each rank's copy is replicated to its peer rank over Gloo after the host copy (its
    real mode); complete when ``finalize_replication()`` says the peer's replica landed."""

    name = "gemini"
    REPLICA_WAIT_S = 600.0  # bound on the replica's landing (a few GiB over loopback Gloo)

    def __init__(self, root: Path, size_mb: int) -> None:
        from lm_resiliency.checkpointing import InMemoryCheckpointManager, InMemoryCkptConfig

        config = InMemoryCkptConfig(
            interval=1,
            disk_flush_interval=0,
            disk_folder=str(root / "gemini"),
            run_id="peers-bench",
            pin_memory=False,
        )
        self.mgr = InMemoryCheckpointManager(config)
        self.replicated = dist.is_initialized() and dist.get_world_size() > 1

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.mgr.save(sd, step)
        stall = time.perf_counter() - t0
        self.mgr.maybe_wait()
        if self.replicated and not self.mgr.finalize_replication(timeout_s=self.REPLICA_WAIT_S):
            raise AssertionError(f"gemini: step {step}'s replica did not land on the peer rank")
        return stall, time.perf_counter() - t0

    def restore(self, dst: dict[str, torch.Tensor], verified: bool = True) -> float:
        t0 = time.perf_counter()
        loaded = self.mgr.load()
        if loaded is None:
            raise AssertionError("gemini: load() found no checkpoint in memory")
        copy_into(dst, loaded[0])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.mgr.close()


PEERS: dict[str, type] = {
    c.name: c for c in (Tierckpt, TierckptCheckpointer, TorchBest, DLRover, Gemini)
}


def why_absent(name: str) -> str | None:
    """Why a peer cannot run in this environment, or None."""
    need = {"dlrover": ("dlrover", "grpc"), "gemini": ("lm_resiliency",)}.get(name, ())
    for mod in need:
        try:
            __import__(mod)
        except Exception as e:  # any import failure: the peer is absent
            return f"{name} skipped: `import {mod}` failed ({type(e).__name__}: {e})"
    return None


def nvrx_reason() -> str:
    try:
        import nvidia_resiliency_ext  # type: ignore[import-not-found]  # noqa: F401
    except Exception:
        return (
            "nvrx skipped: nvidia-resiliency-ext is not installed (its local checkpoints need CUDA)"
        )
    if not torch.cuda.is_available():
        return "nvrx skipped: its local checkpoints need CUDA tensors (no CUDA here)"
    return "nvrx skipped: this CPU benchmark does not run it (CUDA tensors; see gpu_staging.py)"


def build_peers(
    peers: list[Any], names: list[str], root: Path, size_mb: int, sockets: dict[str, str]
) -> None:
    """The contenders, appended to ``peers`` as built (the caller closes them if one fails),
    then in ``names``' order. ``sockets``: the node's daemon of a tierckpt contender, if any."""
    # DLRover forks its saver when built: first, before the others start threads.
    for n in sorted(names, key=lambda n: n != "dlrover"):
        kw = {"socket": sockets[n]} if n in sockets else {}
        peers.append(PEERS[n](root, size_mb, **kw))
    peers.sort(key=lambda p: names.index(p.name))


def one_round(
    i: int,
    sd: dict[str, torch.Tensor],
    dsts: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    peers: list[Any],
    sync: Callable[[], Any] = lambda: None,
    who: str = "",
) -> dict[str, float]:
    """Round ``i``: the state changed, the paired memcpy, every save, every restore (checked);
    the seconds by key. ``sync`` (the ranks' barrier) runs before each timed call."""
    memcpy_dst, dst = dsts
    for t in sd.values():
        t[0] += 1
    sync()
    t0 = time.perf_counter()
    copy_into(memcpy_dst, sd)
    row = {"memcpy": time.perf_counter() - t0}
    order = peers[i % len(peers) :] + peers[: i % len(peers)]
    for p in order:
        sync()
        row[f"{p.name}_stall"], row[f"{p.name}_done"] = p.save(sd, i + 1)
    for p in order:
        kinds = [True, False] if p.name == "tierckpt" else [True]
        for verified in kinds:
            for d in dst.values():
                d.zero_()
            label = p.name if verified else f"{p.name}_unverified"
            sync()
            row[f"{label}_restore"] = p.restore(dst, verified)
            check_equal(dst, sd, f"{who}{label} round {i}")
    return row


def round_line(size_mb: int, i: int, row: dict[str, float]) -> str:
    times = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row.items())
    return f"  {size_mb} MiB round {i}: {times} ms"
