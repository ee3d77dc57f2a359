"""Crash consistency under randomized SIGKILL, with real processes (issue 13).

Two daemons on a ring (two "nodes", replicas 1, a file:// persistent tier with a bandwidth cap so
that uploads lag behind commits) and a 2-rank gloo training loop (``_trainer.py``) that saves step
after step, on one node (both ranks on daemon A; B holds the replicas) or on two (rank r on daemon
r, every step committed across both). Each trial waits a random delay, then SIGKILLs one of: a
trainer rank, the daemon of rank 0 (the decider), or the other daemon (the replica holder, or the
participant of the commit across nodes); a killed daemon is restarted after another random delay,
while the trainer goes on (or fails, and is restarted by the next trial, resuming from "latest").

After every trial, with the trainer paused (SIGSTOP) or dead:

- every step either daemon lists as committed or durable has every file, with the bytes its
  checksum names; every step the persistent tier holds durable has its manifest and files intact;
- "latest" of each namespace (decided by daemon A, as rank 0 does) loads bit-exact in a fresh
  reader, verified, and is never older than the newest save the trainer saw succeed;
- every restarted trainer restored its step bit-exact (it checks, and exits 3 if not).

After the last trial (trainer gone, one lease TTL and one sweep later): nothing of a dead save is
left (no lease, no attempt being written or prepared, no step directory without its commit record)
and the bytes each daemon counts are the bytes its files hold.

CI runs 20 trials (about 2-3 minutes on 2 cores); ``TIERCKPT_LONG=1`` runs 200
(``TIERCKPT_CRASH_TRIALS`` sets any number). The seed is random unless ``TIERCKPT_CRASH_SEED``
is set, and is printed, with the trial, in any failure.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from tierckpt_client import ClientConfig
from tierckpt_client.dcp import TieredStorageReader

from _tiers import durable_problems, leftovers, memory_problems, phases
from _trainer import mismatch, template
from helpers import DaemonProcess, launch_script, ring

pytestmark = pytest.mark.slow

LONG = os.environ.get("TIERCKPT_LONG") == "1"
TRIALS = int(os.environ.get("TIERCKPT_CRASH_TRIALS") or (200 if LONG else 20))
TOKEN = "crash-harness-peer-token-0123456789"
NUMEL = 1 << 16  # 256 KiB of float32 per rank, plus a few small tensors and bytes items
LEASE_TTL_S = 5.0
TRAINER = Path(__file__).with_name("_trainer.py")
TOPOLOGIES = {"local": (0, 0), "span": (0, 1)}  # namespace -> the daemon of each rank
VICTIMS = ("rank 0", "rank 1", "daemon of rank 0", "other daemon")


class Trainer:
    """One incarnation of the 2-rank training loop; rank 0's stdout is read in a thread."""

    def __init__(
        self, namespace: str, daemons: list[DaemonProcess], env: dict[str, str], log_dir: Path
    ):
        self.namespace = namespace
        sockets = ",".join(str(daemons[i].socket) for i in TOPOLOGIES[namespace])
        self.procs = launch_script(
            TRAINER,
            ["--namespace", namespace, "--numel", str(NUMEL)],
            2,
            {**env, "HARNESS_SOCKETS": sockets},
            log_dir=log_dir,
        )
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        out = self.procs[0].stdout
        assert out is not None
        for line in out:
            with self._cv:
                self.lines.append(line.strip())
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def wait_line(self, prefix: str, timeout: float) -> str | None:
        """The first line starting with ``prefix``, or None once rank 0 exits or time is up."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                hit = next((x for x in self.lines if x.startswith(prefix)), None)
                if hit is not None or not self._reader.is_alive():
                    return hit
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 0.5))

    @property
    def saved(self) -> int:
        with self._cv:
            steps = [int(x.split()[1]) for x in self.lines if x.startswith("saved ")]
        return max(steps, default=0)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def signal(self, sig: int, ranks: tuple[int, ...] = (0, 1)) -> None:
        for r in ranks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.procs[r].pid, sig)  # the rank and any helper it started

    def kill(self) -> list[int]:
        self.signal(signal.SIGKILL)
        self.signal(signal.SIGCONT)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=30))
            except subprocess.TimeoutExpired:
                codes.append(-999)
        self._reader.join(timeout=10)
        for p in self.procs:
            if p.stdout is not None:
                p.stdout.close()
        return codes


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[list[DaemonProcess], str]]:
    url = f"file://{tmp_path / 'persistent'}"
    daemons = ring(
        2,
        token=TOKEN,
        replicas=1,
        prefix="tierckpt-crash",
        capacity="256M",
        keep_last=2,
        persist_url=url,
        persist_keep_last=3,
        upload_max_rate="4M",
        lease_ttl_s=LEASE_TTL_S,
        peer_timeout_s=5,
    )
    try:
        for d in daemons:
            d.start()
        yield daemons, url
    finally:
        for d in daemons:
            d.cleanup()


def _load_latest(d: DaemonProcess, url: str, namespace: str) -> int:
    """Load ``namespace``'s latest through ``d`` in this process (a fresh reader, verifying
    reads as by default) and check it bit-exact; the step it resolved."""
    reader = TieredStorageReader(
        namespace, config=ClientConfig.from_env(socket=d.socket, persist_url=url)
    )
    sd = template([0, 1], NUMEL)
    dcp.load(sd, storage_reader=reader, no_dist=True)
    step = reader.resolved_step
    assert step is not None
    problem = mismatch(sd, step, [0, 1], NUMEL)
    assert problem is None, f"latest of {namespace} through {d.name}: {problem}"
    return step


def _logged_about(daemons: list[DaemonProcess], left: list[str]) -> str:
    """What each daemon logged about the save attempts of the step directories in ``left``."""
    attempts = {m.group(1) for x in left if (m := re.search(r"/\d{12}-(\S+)", x))}
    out = []
    for d in daemons:
        try:
            lines = d.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        hits = [line for line in lines if any(a in line for a in attempts)]
        out.append(f"\n--- {d.name}: lines naming {sorted(attempts)} ---\n" + "\n".join(hits[-40:]))
    return "".join(out)


def _run_trials(cluster: tuple[list[DaemonProcess], str], tmp_path: Path, trials: int) -> None:
    daemons, url = cluster
    seed = int(os.environ.get("TIERCKPT_CRASH_SEED") or random.SystemRandom().randrange(1 << 32))
    rng = random.Random(seed)
    env = {"TIERCKPT_PERSIST_URL": url, "TIERCKPT_TIMEOUT": "30"}
    log_dir = tmp_path / "ranks"
    acked: dict[str, int] = {}  # newest step whose save returned, per namespace
    kills: collections.Counter[str] = collections.Counter()
    hit: collections.Counter[str] = collections.Counter()
    restarts = resumed_newer = 0
    trainer: Trainer | None = None
    trial = 0
    started = time.monotonic()

    def context() -> str:
        logs = "".join(
            f"\n--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(log_dir.glob("rank*.log"))
        )
        return f"seed {seed} (TIERCKPT_CRASH_SEED={seed}), trial {trial} of {trials}{logs}"

    try:
        while trial < trials:
            trial += 1
            if trainer is None or not trainer.alive():
                if trainer is not None:
                    codes = trainer.kill()
                    assert 3 not in codes, f"a rank restored a wrong step: {context()}"
                for p in log_dir.glob("rank*.log"):
                    p.unlink()
                namespace = rng.choice(sorted(TOPOLOGIES))
                trainer = Trainer(namespace, daemons, env, log_dir)
                restarts += 1
                line = trainer.wait_line("resumed ", 120)
                assert line is not None, f"the trainer did not resume: {trainer.lines} {context()}"
                start = int(line.split()[1])
                assert start >= acked.get(namespace, 0), (
                    f"{namespace} resumed from step {start}, older than step "
                    f"{acked[namespace]} whose save returned: {context()}"
                )
                resumed_newer += start > acked.get(namespace, 0)
            assert trainer is not None
            ns = trainer.namespace
            time.sleep(rng.uniform(0.0, 1.5))
            victim = rng.choice(VICTIMS)
            kills[victim] += 1
            if victim.startswith("rank"):
                r = int(victim[-1])
                trainer.signal(signal.SIGKILL, (r,))
                seen = phases(daemons[TOPOLOGIES[ns][r]].shm_dir)
            else:
                d = daemons[0 if victim == "daemon of rank 0" else 1]
                d.kill()
                seen = phases(d.shm_dir)
                time.sleep(rng.uniform(0.0, 1.0))
                d.start()
            hit.update(seen)
            time.sleep(rng.uniform(0.2, 1.0))  # the survivors go on, or fail
            if trainer.alive():
                trainer.signal(signal.SIGSTOP)
            else:
                trainer.kill()
            acked[ns] = max(acked.get(ns, 0), trainer.saved)
            try:
                problems = []
                for d in daemons:
                    for n in TOPOLOGIES:
                        problems += memory_problems(d, n)
                for n in TOPOLOGIES:
                    problems += durable_problems(url, n)[1]
                assert not problems, f"{problems} after killing {victim}: {context()}"
                for n, step in acked.items():
                    if not step:
                        continue
                    latest = _load_latest(daemons[0], url, n)
                    assert latest >= step, (
                        f"latest of {n} is step {latest}, older than step {step} whose save "
                        f"returned; killed {victim}: {context()}"
                    )
            finally:
                if trainer.alive():
                    trainer.signal(signal.SIGCONT)
        elapsed = time.monotonic() - started
        if trainer is not None:
            codes = trainer.kill()
            assert 3 not in codes, f"a rank restored a wrong step: {context()}"
        # One TTL for leases and stalled attempts, one sweep, one in-doubt resolution.
        deadline = time.monotonic() + LEASE_TTL_S + 30
        left: list[str] = []
        while time.monotonic() < deadline:
            left = [f"{d.name}: {x}" for d in daemons for x in leftovers(d)]
            if not left:
                break
            time.sleep(0.5)
        assert not left, f"not reclaimed: {left}; {context()}{_logged_about(daemons, left)}"
        durable = {n: durable_problems(url, n)[0] for n in TOPOLOGIES}
        print(
            f"\ncrash harness: seed {seed}, {trials} trials in {elapsed:.0f}s, {restarts} trainer "
            f"starts, kills {dict(kills)}, state at the kill {dict(hit)}, newest saved {acked}, "
            f"durable steps kept {durable}, resumed from a step newer than the last save that "
            f"returned: {resumed_newer}; nothing lost, nothing torn, leftovers reclaimed"
        )
    finally:
        if trainer is not None:
            trainer.kill()


@pytest.mark.timeout(7200 if LONG else 600)
def test_random_sigkills_never_lose_a_saved_step_nor_tear_one(
    cluster: tuple[list[DaemonProcess], str], tmp_path: Path
) -> None:
    _run_trials(cluster, tmp_path, TRIALS)
