"""Pre-leases in the daemon (TierService on a real directory, no HTTP): granted when the save
attempt they wait for commits, from the file it frees; counted against the budget; taken back under
pressure and when they expire, unless a trainer holds them (``flock``)."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tierckpt_core.errors import CapacityExceededError, LeaseNotFoundError
from tierckpt_core.protocol import CommitRequest, LeaseAfter, SealFile, SealRequest
from tierckpt_daemon.tier.arena import Arena
from tierckpt_daemon.tier.service import TierService

MiB = 1 << 20


def make(root: Path, capacity: int = 64 * MiB, keep_last: int = 1, ttl: float = 60) -> TierService:
    svc = TierService(Arena(root, capacity), keep_last=keep_last, lease_ttl_s=ttl, spares=False)
    svc.rebuild()
    return svc


def seal(svc: TierService, ns: str, step: int, lease_id: str, size: int = MiB) -> None:
    files = [SealFile(lease_id=lease_id, name="r0", length=size)]
    svc.seal(ns, step, f"a{step}", SealRequest(rank=0, files=files))


def commit(svc: TierService, ns: str, step: int) -> None:
    req = CommitRequest(files=["r0"], metadata={"step": step}, world_size=1)
    svc.commit(ns, step, f"a{step}", req)


def save(svc: TierService, ns: str, step: int, size: int = MiB) -> int:
    """A whole save of one file; its inode."""
    lease = svc.lease(ns, 0, size)
    ino = os.stat(lease.path).st_ino
    seal(svc, ns, step, lease.lease_id, size)
    commit(svc, ns, step)
    return ino


@contextmanager
def claimed(path: str) -> Iterator[None]:
    """Hold the file as a trainer's claim does."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def test_a_pre_lease_is_the_file_the_commit_frees_and_a_save_seals_it(tmp_path: Path) -> None:
    svc = make(tmp_path / "tier")
    first = save(svc, "job", 1)
    lease = svc.lease("job", 0, MiB)
    seal(svc, "job", 2, lease.lease_id)
    pre = svc.lease("job", 0, MiB, after=LeaseAfter(step=2, attempt="a2"))
    assert pre.pending and pre.size == MiB
    assert not os.path.exists(pre.path)  # named now, in place at the commit
    assert svc.arena.used_bytes == 2 * MiB
    commit(svc, "job", 2)  # retires step 1: its file becomes the pre-lease
    st = os.stat(pre.path)
    assert (st.st_ino, st.st_size) == (first, MiB)
    assert svc.arena.used_bytes == 2 * MiB  # counted like any lease, no new memory
    assert svc.leases.held_bytes == MiB
    with claimed(pre.path):
        with open(pre.path, "r+b") as f:
            f.write(b"three")
        seal(svc, "job", 3, pre.lease_id)
    commit(svc, "job", 3)
    path = svc.pin("job", 3).paths["r0"]
    assert Path(path).read_bytes()[:5] == b"three"


def test_no_pre_lease_when_the_commit_frees_no_file(tmp_path: Path) -> None:
    svc = make(tmp_path / "tier", keep_last=2)
    lease = svc.lease("job", 0, MiB)
    seal(svc, "job", 1, lease.lease_id)
    pre = svc.lease("job", 0, MiB, after=LeaseAfter(step=1, attempt="a1"))
    commit(svc, "job", 1)  # retention frees nothing yet: no file, no new allocation
    assert not os.path.exists(pre.path)
    assert svc.arena.used_bytes == MiB
    with pytest.raises(LeaseNotFoundError):
        seal(svc, "job", 2, pre.lease_id)


def test_a_pre_lease_asked_after_the_commit_is_granted_and_after_an_abort_is_not(
    tmp_path: Path,
) -> None:
    """The trainer asks beside its commit, so the request may come after the attempt ended: a
    committed attempt's pre-lease is granted at once from the file the commit freed; one of an
    attempt that was aborted (or never existed) gets no file and takes none from the pool."""
    svc = make(tmp_path / "tier")
    first = save(svc, "job", 1)
    save(svc, "job", 2)  # retires step 1: its file is in the pool
    pre = svc.lease("job", 0, MiB, after=LeaseAfter(step=2, attempt="a2"))
    assert os.stat(pre.path).st_ino == first
    assert svc.leases.held_bytes == MiB
    svc.release_lease("job", pre.lease_id)
    lease = svc.lease("job", 0, MiB)
    seal(svc, "job", 3, lease.lease_id)
    svc.abort("job", 3, "a3")
    pool = svc.arena.pool_bytes
    for step, attempt in ((3, "a3"), (4, "a4"), (2, "older")):
        late = svc.lease("job", 0, MiB, after=LeaseAfter(step=step, attempt=attempt))
        assert not os.path.exists(late.path), (step, attempt)
        assert (svc.arena.pool_bytes, svc.leases.held_bytes) == (pool, 0)
        with pytest.raises(LeaseNotFoundError):
            seal(svc, "job", 5, late.lease_id)
    assert [s.step for s in svc.list_steps("job")] == [2]


def test_an_unclaimed_pre_lease_is_taken_back_for_another_jobs_save(tmp_path: Path) -> None:
    svc = make(tmp_path / "tier", capacity=3 * MiB)
    save(svc, "job", 1)
    lease = svc.lease("job", 0, MiB)
    seal(svc, "job", 2, lease.lease_id)
    pre = svc.lease("job", 0, MiB, after=LeaseAfter(step=2, attempt="a2"))
    commit(svc, "job", 2)
    assert os.path.exists(pre.path)
    save(svc, "other", 1)  # 3 MiB in use: job's step 2, its pre-lease, other's step 1
    # A save that fits only with the pre-lease's memory gets it, and evicts no committed step.
    big = svc.lease("other", 0, MiB)
    assert not os.path.exists(pre.path)
    assert [s.step for s in svc.list_steps("job")] == [2]
    assert svc.arena.used_bytes <= 3 * MiB
    svc.release_lease("other", big.lease_id)


def test_a_claimed_pre_lease_is_not_taken_back(tmp_path: Path) -> None:
    svc = make(tmp_path / "tier", capacity=3 * MiB)
    save(svc, "job", 1)
    lease = svc.lease("job", 0, MiB)
    seal(svc, "job", 2, lease.lease_id)
    pre = svc.lease("job", 0, MiB, after=LeaseAfter(step=2, attempt="a2"))
    commit(svc, "job", 2)
    save(svc, "other", 1)
    with claimed(pre.path):
        with pytest.raises(CapacityExceededError, match="does not fit"):
            svc.lease("other", 0, MiB)
        assert os.path.exists(pre.path)
        seal(svc, "job", 3, pre.lease_id)  # the trainer's save goes through
    commit(svc, "job", 3)
    assert svc.latest("job").step == 3


def test_a_dead_trainers_pre_lease_expires_and_a_claimed_one_is_renewed_once(
    tmp_path: Path,
) -> None:
    # The TTL is long enough that a loaded machine never lets the pre-lease's wait for step 2
    # expire between asking and committing; the sleeps outlast it.
    ttl = 0.5
    svc = make(tmp_path / "tier", ttl=ttl)
    for pre_claimed in (False, True):
        save(svc, "job", 1)
        lease = svc.lease("job", 0, MiB)
        seal(svc, "job", 2, lease.lease_id)
        pre = svc.lease("job", 0, MiB, after=LeaseAfter(step=2, attempt="a2"))
        commit(svc, "job", 2)
        assert os.path.exists(pre.path)
        time.sleep(ttl * 1.5)
        if not pre_claimed:  # nobody holds it: gone at the first sweep past its TTL
            svc.sweep()
            assert not os.path.exists(pre.path)
            assert svc.leases.held_bytes == 0
            svc.delete_step("job", 2)
            continue
        with claimed(pre.path):
            svc.sweep()  # held: it lives one more TTL
            assert os.path.exists(pre.path)
            time.sleep(ttl * 1.5)
            svc.sweep()  # held past that too: reclaimed like a plain lease
            assert not os.path.exists(pre.path)
    assert svc.leases.held_bytes == 0


def test_an_older_unclaimed_pre_lease_of_the_rank_goes_back_when_a_newer_one_is_granted(
    tmp_path: Path,
) -> None:
    svc = make(tmp_path / "tier")
    save(svc, "job", 1)
    paths = []
    for step in (2, 3):
        lease = svc.lease("job", 0, MiB)
        seal(svc, "job", step, lease.lease_id)
        paths.append(svc.lease("job", 0, MiB, after=LeaseAfter(step=step, attempt=f"a{step}")).path)
        commit(svc, "job", step)
    assert not os.path.exists(paths[0]) and os.path.exists(paths[1])
    assert svc.leases.held_bytes == MiB


def test_a_pending_pre_lease_can_be_released_before_its_commit(tmp_path: Path) -> None:
    svc = make(tmp_path / "tier")
    save(svc, "job", 1)
    lease = svc.lease("job", 0, MiB)
    seal(svc, "job", 2, lease.lease_id)
    pre = svc.lease("job", 0, MiB, after=LeaseAfter(step=2, attempt="a2"))
    svc.release_lease("job", pre.lease_id)
    commit(svc, "job", 2)
    assert not os.path.exists(pre.path)
    assert svc.arena.pool_files == 1


def test_each_rank_gets_back_the_file_it_wrote_whichever_asks_first(tmp_path: Path) -> None:
    """The files a commit frees go back to the ranks that wrote them: a rank that gets another
    rank's file maps it afresh in its process (page faults on the stall's copy, a CUDA
    registration again), however the ranks' requests interleave."""
    svc = make(tmp_path / "tier")

    def two_rank_save(step: int) -> dict[int, int]:
        inodes = {}
        for rank in (0, 1):
            lease = svc.lease("job", rank, MiB)
            inodes[rank] = os.stat(lease.path).st_ino
            files = [SealFile(lease_id=lease.lease_id, name=f"r{rank}", length=MiB)]
            svc.seal("job", step, f"a{step}", SealRequest(rank=rank, files=files))
        return inodes

    def commit_two(step: int) -> None:
        req = CommitRequest(files=["r0", "r1"], metadata={"step": step}, world_size=2)
        svc.commit("job", step, f"a{step}", req)

    first = two_rank_save(1)
    commit_two(1)
    two_rank_save(2)
    # Rank 1 asks first: the pool lists rank 0's file first (the step's files in order).
    pre = {
        rank: svc.lease("job", rank, MiB, after=LeaseAfter(step=2, attempt="a2")) for rank in (1, 0)
    }
    commit_two(2)  # retires step 1: its two files become the pre-leases
    assert {rank: os.stat(p.path).st_ino for rank, p in pre.items()} == first
    # A plain lease too: step 2's files come back to their ranks when step 3 retires it.
    pinned = svc.pin("job", 2)
    second = {rank: os.stat(pinned.paths[f"r{rank}"]).st_ino for rank in (0, 1)}
    svc.unpin("job", 2, pinned.pin_id)
    svc.leases.release("job", pre[0].lease_id)
    svc.leases.release("job", pre[1].lease_id)
    third = two_rank_save(3)
    commit_two(3)
    assert sorted(third.values()) == sorted(first.values())
    for rank in (1, 0):
        lease = svc.lease("job", rank, MiB)
        assert os.stat(lease.path).st_ino == second[rank], rank
