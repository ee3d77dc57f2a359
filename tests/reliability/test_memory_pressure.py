"""Memory pressure: over a thousand saves of random sizes into a tier far smaller than what they
add up to (issue 13).

Four jobs share one daemon with a tight ``TIERCKPT_CAPACITY``: three persist every step to a
file:// persistent tier whose uploads are capped well below the rate of the saves (so steps
waiting for their upload pile up), one keeps its steps in memory only (``persist=False``). Saves go
through the daemon's raw API (lease, write, seal, commit, as the writer does) for speed, with DCP
saves and loads mixed in. A thread samples the daemon's status and the bytes of the files in its
tier directory the whole time. What must hold, and is checked:

- the daemon's accounted bytes, and the bytes its files hold, never exceed the capacity;
- no step waiting for its upload is evicted to make room: every step that left memory is durable,
  was retired by retention (``TIERCKPT_KEEP_LAST`` newer steps of its job were committed), or is a
  memory-only step given up under pressure; the newest step of each job is always in memory;
- a save that does not fit fails at once with ``CapacityExceededError`` naming the problem, or,
  with the writer's default ``on_unavailable="persist"``, goes straight to the persistent tier and
  loads back bit-exact (async_save and plain save alike).

``TIERCKPT_PRESSURE_SAVES`` sets the number of raw saves (default 1,200).
"""

from __future__ import annotations

import collections
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from tierckpt_client import CapacityExceededError, ClientConfig, DaemonClient
from tierckpt_core.errors import NotFoundError
from tierckpt_core.layout import marker_key
from tierckpt_core.protocol import CommitRequest, SealFile

from helpers import DaemonProcess, free_port, started
from kit import blank_state, load, save, seeded_state

SAVES = int(os.environ.get("TIERCKPT_PRESSURE_SAVES") or 1200)
CAPACITY = 6 << 20
KEEP_LAST = 2
PERSISTED = ("job-a", "job-b", "job-c")
MEMORY_ONLY = "scratch"


def _size(rng: random.Random) -> int:
    """Mostly small files, some large, a few of a quarter of the tier."""
    roll = rng.random()
    if roll < 0.70:
        return rng.randint(1, 64 << 10)
    if roll < 0.95:
        return rng.randint(64 << 10, 512 << 10)
    return rng.randint(512 << 10, 1536 << 10)


class Sampler(threading.Thread):
    """Samples the daemon's accounted bytes and the bytes its tier's files hold, until stopped."""

    def __init__(self, d: DaemonProcess) -> None:
        super().__init__(daemon=True)
        self.d = d
        self.max_used = self.max_on_disk = self.samples = 0
        self.over: list[str] = []
        self._done = threading.Event()

    def run(self) -> None:
        with DaemonClient.from_socket(self.d.socket) as c:
            while not self._done.is_set():
                used = c.status().used_bytes
                on_disk = _bytes_on_disk(self.d.shm_dir)
                self.max_used = max(self.max_used, used)
                self.max_on_disk = max(self.max_on_disk, on_disk)
                self.samples += 1
                if used > CAPACITY or on_disk > CAPACITY:
                    self.over.append(f"accounted {used}, files {on_disk} > capacity {CAPACITY}")
                self._done.wait(0.01)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=30)


def _bytes_on_disk(root: Path) -> int:
    """Bytes the tier's data files held at one moment (a lower bound), from a walk that is not
    atomic: files come and go while it runs (a pool file deleted, then a new lease allocated), so
    the sum of one walk can count two files that never existed together. Each file seen is looked
    at again once the walk is over, and counted only if it is still the same file (inode): all
    those existed together at the moment the walk ended (tmpfs does not reuse an inode at once).
    A file renamed meanwhile (sealed, evicted to the pool) is left out, so this can undercount
    but never overcount."""
    seen: dict[int, tuple[str, int]] = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            if n.startswith("MANIFEST") or n.startswith("daemon."):
                continue
            path = os.path.join(dirpath, n)
            st = _lstat(path)
            if st is not None:
                seen[st.st_ino] = (path, _size_of(st))
    total = 0
    for ino, (path, size) in seen.items():
        st = _lstat(path)
        if st is not None and st.st_ino == ino:
            total += min(size, _size_of(st))  # files only shrink in place (pool reuse)
    return total


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _size_of(st: os.stat_result) -> int:
    return max(st.st_blocks * 512, st.st_size)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Path]]:
    store = tmp_path / "persistent"
    with started(
        capacity=f"{CAPACITY}B",  # a unit: a tier this small is meant
        keep_last=KEEP_LAST,
        persist_url=f"file://{store}",
        upload_max_rate="1M",
        port=free_port(),
        lease_ttl_s=30,
    ) as d:
        yield d, store


def _raw_save(
    c: DaemonClient, ns: str, step: int, sizes: list[int], rng: random.Random
) -> str | None:
    """Lease, write, seal and commit one step of ``len(sizes)`` ranks' files, as a writer does;
    the error of a lease that did not fit (its leases given back), else None."""
    leases = []
    try:
        for rank, size in enumerate(sizes):
            leases.append(c.lease(ns, rank, size))
    except CapacityExceededError as e:
        for lease in leases:
            c.release(ns, lease.lease_id)
        return str(e)
    attempt = f"a{rng.getrandbits(48):012x}"
    for rank, (lease, size) in enumerate(zip(leases, sizes, strict=True)):
        head = f"{ns}/{step}/{rank}".encode()
        fd = os.open(lease.path, os.O_WRONLY)
        try:
            os.pwrite(fd, head, 0)
            os.pwrite(fd, head, size - len(head)) if size > 2 * len(head) else None
        finally:
            os.close(fd)
        name = f"r{rank:05d}.data"
        c.seal(ns, step, attempt, rank, [SealFile(lease_id=lease.lease_id, name=name, length=size)])
    c.commit(
        ns,
        step,
        attempt,
        CommitRequest(
            files=[f"r{r:05d}.data" for r in range(len(sizes))],
            metadata={},
            world_size=len(sizes),
            persist=ns != MEMORY_ONLY,
        ),
    )
    return None


def _in_memory(c: DaemonClient, ns: str) -> set[int]:
    try:
        return {s.step for s in c.steps(ns) if s.state.value != "writing"}
    except NotFoundError:
        return set()


def _config(d: DaemonProcess, url: str) -> ClientConfig:
    return ClientConfig.from_env(socket=d.socket, persist_url=url)


def _assert_loads(d: DaemonProcess, url: str, ns: str, step: int, numel: int) -> None:
    _, out = load(ns, blank_state(numel), step, config=_config(d, url))
    want = seeded_state(step, numel)
    assert torch.equal(out["w"], want["w"]) and out["meta"] == want["meta"], f"{ns}/{step}"


def _dcp_save(
    d: DaemonProcess, url: str, ns: str, step: int, numel: int, *, policy: str, plain: bool
) -> None:
    state = seeded_state(step, numel)
    save(ns, step, state, config=_config(d, url), on_unavailable=policy, staged=not plain)


def _metric(d: DaemonProcess, name: str, label: str = "") -> float:
    text = httpx.get(f"http://127.0.0.1:{d.settings['port']}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.timeout(900)
def test_saves_under_a_tight_budget_never_exceed_it_nor_drop_a_step_waiting_for_upload(
    tier: tuple[DaemonProcess, Path],
) -> None:
    d, store = tier
    url = f"file://{store}"
    seed = int(os.environ.get("TIERCKPT_PRESSURE_SEED") or random.SystemRandom().randrange(1 << 32))
    rng = random.Random(seed)
    where = f"(seed {seed}: TIERCKPT_PRESSURE_SEED={seed})"
    jobs = (*PERSISTED, MEMORY_ONLY)
    committed: dict[str, list[int]] = {ns: [] for ns in jobs}
    memory: dict[str, set[int]] = {ns: set() for ns in jobs}
    left: collections.Counter[str] = collections.Counter()
    rejected: list[str] = []
    dcp_outcomes: collections.Counter[str] = collections.Counter()
    sampler = Sampler(d)
    sampler.start()
    try:
        with DaemonClient.from_socket(d.socket) as c:
            for i in range(1, SAVES + 1):
                ns = rng.choice(jobs)
                step = (committed[ns][-1] if committed[ns] else 0) + 1
                if i % 50 == 0:  # a DCP save among the raw ones, by either policy
                    policy = "raise" if i % 100 else "persist"
                    try:
                        _dcp_save(d, url, "dcp", i, 100_000, policy=policy, plain=i % 150 == 0)
                    except BaseException as e:  # DCP wraps a plain save's error
                        assert policy == "raise" and "does not fit in the memory tier" in str(
                            [e, *_causes(e)]
                        ), e
                        dcp_outcomes["raise: refused"] += 1
                    else:
                        where_to = "memory" if i in _in_memory(c, "dcp") else "persistent tier"
                        assert where_to == "memory" or policy == "persist", f"{i}: {where_to}"
                        dcp_outcomes[f"{policy}: saved to {where_to}"] += 1
                        _assert_loads(d, url, "dcp", i, 100_000)
                sizes = [_size(rng) for _ in range(rng.choice((1, 1, 2)))]
                err = _raw_save(c, ns, step, sizes, rng)
                if err is not None:
                    assert "does not fit in the memory tier" in err and "TIERCKPT_CAPACITY" in err
                    rejected.append(err)
                else:
                    committed[ns].append(step)
                for job in jobs:
                    now = _in_memory(c, job)
                    for gone in sorted(memory[job] - now):
                        newer = sum(1 for s in committed[job] if s > gone)
                        if (store / marker_key(job, gone)).exists():
                            left["durable"] += 1
                        elif newer >= KEEP_LAST:
                            left["retention"] += 1
                        elif job == MEMORY_ONLY:
                            left["memory-only, pressure"] += 1
                        else:
                            pytest.fail(
                                f"{job}/step {gone} left memory before it was durable, with only "
                                f"{newer} newer steps committed (save {i}) {where}"
                            )
                    if committed[job]:
                        assert committed[job][-1] in now, (
                            f"the newest step of {job} ({committed[job][-1]}) is not in memory "
                            f"(save {i}) {where}"
                        )
                    memory[job] = now
    finally:
        sampler.stop()
    assert not sampler.over, f"{sampler.over[:5]} {where}"
    assert sampler.samples > 100
    pressure = _metric(d, "tierckpt_evictions_total", 'reason="pressure"')
    skips = _metric(d, "tierckpt_upload_skips_total")
    uploaded = _metric(d, "tierckpt_uploaded_steps_total")
    # The run exercised what it claims to: the tier was full, and steps left it under pressure.
    assert rejected and pressure > 0, f"no pressure: {len(rejected)} rejected, {pressure} {where}"
    print(
        f"\nmemory pressure: seed {seed}, {SAVES} raw saves ({sum(map(len, committed.values()))} "
        f"committed, {len(rejected)} refused: does not fit) + DCP saves {dict(dcp_outcomes)}; capacity "
        f"{CAPACITY}, max accounted {sampler.max_used}, max in files {sampler.max_on_disk} "
        f"({sampler.samples} samples); steps that left memory {dict(left)}; pressure evictions "
        f"{pressure:.0f}, uploads {uploaded:.0f}, uploads skipped (retention) {skips:.0f}"
    )


@pytest.mark.parametrize("plain", [False, True], ids=["async_save", "save"])
def test_a_save_larger_than_the_tier_follows_the_writers_policy(
    tier: tuple[DaemonProcess, Path], plain: bool
) -> None:
    d, store = tier
    url = f"file://{store}"
    numel = CAPACITY // 4 + 1000  # float32: a little more than the whole tier
    _dcp_save(d, url, "small", 1, 1000, policy="raise", plain=plain)
    with pytest.raises(BaseException) as err:  # DCP wraps a plain save's error
        _dcp_save(d, url, "big", 1, numel, policy="raise", plain=plain)
    assert "does not fit in the memory tier" in str(err.value) or any(
        "does not fit in the memory tier" in str(e) for e in _causes(err.value)
    ), err.value
    with DaemonClient.from_socket(d.socket) as c:
        assert _in_memory(c, "small") == {1}  # nothing was evicted for it
    _dcp_save(d, url, "big", 2, numel, policy="persist", plain=plain)
    assert (store / marker_key("big", 2)).exists()  # straight to the persistent tier
    _assert_loads(d, url, "big", 2, numel)
    _assert_loads(d, url, "small", 1, 1000)


def _causes(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for f in failures.values():
            out.append(f[0] if isinstance(f, tuple) else f)
    return out
