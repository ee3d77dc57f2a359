"""Test helpers: real daemons in subprocesses on real Unix sockets (the project's one launcher,
:mod:`tierckpt_core.launcher`), and gloo ranks in processes of their own (:func:`run_ranks`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tierckpt_core import launcher
from tierckpt_core.launcher import DaemonProcess, free_port, ring

__all__ = [
    "DaemonProcess",
    "free_port",
    "launch_script",
    "new_shm_dir",
    "other_workers_paused",
    "other_workers_share",
    "ring",
    "run_ranks",
    "running",
    "started",
    "wait_until",
]

_T = TypeVar("_T")


def wait_until(
    what: str,
    check: Callable[[], _T | None],
    timeout: float = 60.0,
    *,
    describe: Callable[[], object] | None = None,
) -> _T:
    """Poll ``check`` every 50 ms until it returns something true, and return that; after
    ``timeout`` seconds fail naming ``what``, the last value seen and ``describe()`` if given."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            more = f"; {describe()}" if describe is not None else ""
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what}: last saw {got!r}{more}"
            )
        time.sleep(0.05)


@contextlib.contextmanager
def running(nodes: list[DaemonProcess]) -> Iterator[list[DaemonProcess]]:
    """``nodes`` started, and cleaned up (stopped, tier removed) however the block ends."""
    try:
        for d in nodes:
            d.start()
        yield nodes
    finally:
        for d in nodes:
            d.cleanup()


def _workers_lock() -> Path | None:
    """The lock file the test workers of this run (pytest-xdist's ``-n``) share; None when the
    tests run in one process."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return Path(tempfile.gettempdir()) / f"tierckpt-tests-{uid}.lock" if uid else None


@contextlib.contextmanager
def _workers_flock(how: int) -> Iterator[None]:
    path = _workers_lock()
    if path is None:
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, how)  # unlocked when the file closes, however the block ends
        yield


def other_workers_share() -> contextlib.AbstractContextManager[None]:
    """Held around every test (tests/conftest.py): the other workers may run theirs at the same
    time, unless one holds :func:`other_workers_paused`."""
    return _workers_flock(fcntl.LOCK_SH)


def other_workers_paused() -> contextlib.AbstractContextManager[None]:
    """While held, no other test worker runs a test: for tests whose bounds are tight enough
    that another test's load beside them breaks them (the network-fault scenarios' 2 s peer
    timeout). Waits for the others' current tests to end."""
    return _workers_flock(fcntl.LOCK_EX)


def new_shm_dir() -> Path:
    return launcher.new_shm_dir("tierckpt-test")


@contextlib.contextmanager
def started(**settings: Any) -> Iterator[DaemonProcess]:
    """One daemon with these ``TIERCKPT_*`` settings on a fresh tier directory, started, and
    cleaned up (stopped, tier removed) however the block ends. In a test, the ``make_node``
    fixture does the same without the block."""
    d = DaemonProcess(new_shm_dir(), **settings)
    try:
        yield d.start()
    finally:
        d.cleanup()


# What every rank imports, imported once in the process the ranks are forked from (run_ranks).
_RANK_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "tierckpt_client.dcp",
    "tierckpt_client.checkpointer",
    "pytest",
    "helpers",
    "kit",
]


def _rank_entry(
    rank: int,
    fn: Callable[..., None],
    world_size: int,
    store: str,
    env: dict[str, str],
    args: tuple[Any, ...],
) -> None:
    import atexit

    import torch.distributed as dist

    try:
        # The test's environment now (the forkserver's is that of the first test that started it).
        os.environ.clear()
        os.environ.update(env)
        # DCP's checkpoint process (PROCESS mode) puts its own store on MASTER_ADDR: loopback only.
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ["LOCAL_RANK"] = str(rank)
        # A file rendezvous: no TCP port to pick, so no race with another process taking it
        # between free_port() and the store's bind (gloo's own connections bind port 0).
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size
        )
        try:
            fn(rank, world_size, *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    finally:
        # A forked child leaves by os._exit, past the interpreter's exit: run what the rank's
        # modules registered for it (the client gives back pins sent ahead, reads answers owed,
        # the Checkpointer destroys its groups), as a rank started afresh would at its exit.
        atexit._run_exitfuncs()


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes on one gloo group.

    The ranks are forked from a forkserver that imported torch, torch.distributed and the client
    once (:data:`_RANK_PRELOAD`) for the whole test session, rather than spawned (each import
    afresh: several CPU-seconds a rank); each rank takes this process's environment as it is now.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)  # (no effect once the forkserver runs)
    with tempfile.TemporaryDirectory(prefix="tierckpt-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _rank_entry,
            args=(fn, world_size, store, dict(os.environ), args),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )


def launch_script(
    script: str | os.PathLike[str],
    args: list[str],
    world_size: int,
    env: dict[str, str],
    *,
    log_dir: Path,
) -> list[Any]:
    """Start ``world_size`` ranks of a training script as plain processes (the environment
    torchrun would give them, on one gloo rendezvous); rank 0's stdout is a pipe, each rank's
    stderr goes to ``log_dir/rank<N>.log``. The caller waits for (or kills) the processes."""
    import subprocess
    import sys

    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            **env,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a rank that aborts leaves its threads' stacks in its log
        }
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / f"rank{rank}.log", "ab") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, os.fspath(script), *args],
                    env=rank_env,
                    stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                    stderr=err,
                    text=True,
                    start_new_session=True,  # killpg reaches the rank's own helper processes
                )
            )
    return procs


class LoopRun:
    """What a training script's rank 0 printed: ``start <step>`` and ``step <n> loss <hex>``."""

    def __init__(
        self, lines: list[str], returncodes: list[int | None], log_dir: Path | None = None
    ) -> None:
        self.lines = lines
        self.returncodes = returncodes
        self.log_dir = log_dir
        self.start = next((int(x.split()[1]) for x in lines if x.startswith("start ")), None)
        self.losses = {
            int(x.split()[1]): x.split()[3]
            for x in lines
            if x.startswith("step ") and " loss " in x
        }

    def __repr__(self) -> str:
        """What an assertion shows: exit codes, rank 0's output, and each rank's stderr tail
        (a rank that died of a signal says why only there)."""
        logs = ""
        if self.log_dir is not None:
            for p in sorted(self.log_dir.glob("rank*.log")):
                logs += f"\n--- {p.name} ---\n{p.read_text(errors='replace')[-4000:]}"
        return f"LoopRun(returncodes={self.returncodes}, lines={self.lines}){logs}"


def run_loop(
    script: str | os.PathLike[str],
    args: list[str],
    env: dict[str, str],
    *,
    log_dir: Path,
    world_size: int = 2,
    stop_after: int | None = None,
    stop_signal: int = 9,
    signal_ranks: list[int] | None = None,
    timeout: float = 150.0,
) -> LoopRun:
    """Run a training script on ``world_size`` ranks to the end, or until rank 0 prints step
    ``stop_after``; then send ``stop_signal`` (SIGKILL: to each rank's process group, helpers
    included; another signal: to the ``signal_ranks`` only) and wait for the ranks to exit."""
    import signal
    import threading

    procs = launch_script(script, args, world_size, env, log_dir=log_dir)
    # A hung run is killed (its ranks then exit with -9, which the caller's asserts show).
    timer = threading.Timer(timeout, lambda: [_killpg(p.pid) for p in procs])
    timer.start()
    lines: list[str] = []
    try:
        out = procs[0].stdout
        assert out is not None
        for line in out:
            lines.append(line.strip())
            if stop_after is not None and line.startswith(f"step {stop_after} "):
                if stop_signal == signal.SIGKILL:
                    for p in procs:
                        _killpg(p.pid)
                else:
                    for r in signal_ranks if signal_ranks is not None else range(world_size):
                        os.kill(procs[r].pid, stop_signal)
                stop_after = None
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        timer.cancel()
        for p in procs:
            _killpg(p.pid)
            if p.stdout is not None:
                p.stdout.close()
    return LoopRun(lines, list(codes), log_dir)


def _killpg(pid: int) -> None:
    import contextlib
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pid, signal.SIGKILL)
