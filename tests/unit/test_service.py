"""TierService on a real directory, without HTTP: the state machine, retention, pins, rebuild."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

import pytest

from tierckpt_core.errors import (
    CapacityExceededError,
    LeaseNotFoundError,
    NamespaceNotFoundError,
    StepNotFoundError,
    StepStateError,
)
from tierckpt_core.manifest import FileRecord
from tierckpt_core.metadata_blob import unpack_metadata
from tierckpt_core.protocol import CommitRequest, SealFile, SealRequest
from tierckpt_daemon.node import Node
from tierckpt_daemon.tier.arena import Arena
from tierckpt_daemon.tier.hydration import fill_step
from tierckpt_daemon.tier.records import read_manifest
from tierckpt_daemon.tier.restore import Restorer
from tierckpt_daemon.tier.service import TierService

MiB = 1 << 20


def make(root: Path, capacity: int = 64 * MiB, keep_last: int = 2) -> TierService:
    svc = TierService(Arena(root, capacity), keep_last=keep_last, lease_ttl_s=60, spares=False)
    svc.rebuild()
    return svc


def save(svc: TierService, ns: str, step: int, size: int = MiB, attempt: str = "a1") -> list[str]:
    lease = svc.lease(ns, 0, size)
    with open(lease.path, "r+b") as f:
        f.write(step.to_bytes(8, "little"))
    svc.seal(
        ns,
        step,
        attempt,
        SealRequest(rank=0, files=[SealFile(lease_id=lease.lease_id, name="r0", length=size)]),
    )
    svc.commit(
        ns, step, attempt, CommitRequest(files=["r0"], metadata={"step": step}, world_size=1)
    )
    return [lease.path]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "tier"


def test_commit_makes_step_visible_with_metadata(root: Path) -> None:
    svc = make(root)
    save(svc, "job", 3)
    assert svc.latest("job").step == 3
    assert unpack_metadata(svc.metadata("job", 3), where="test") == {"step": 3}
    pin = svc.pin("job", 3)
    with open(pin.paths["r0"], "rb") as f:
        assert int.from_bytes(f.read(8), "little") == 3


def test_commit_with_unsealed_file_is_refused(root: Path) -> None:
    svc = make(root)
    lease = svc.lease("job", 0, 100)
    svc.seal(
        "job",
        1,
        "a",
        SealRequest(rank=0, files=[SealFile(lease_id=lease.lease_id, name="r0", length=100)]),
    )
    with pytest.raises(StepStateError, match="1 files were never sealed: r1"):
        svc.commit("job", 1, "a", CommitRequest(files=["r0", "r1"], metadata={}, world_size=2))
    with pytest.raises(LeaseNotFoundError, match="unknown or expired"):
        svc.seal(
            "job",
            1,
            "a",
            SealRequest(rank=1, files=[SealFile(lease_id="nope", name="r1", length=1)]),
        )


def test_keep_last_recycles_into_pool(root: Path) -> None:
    svc = make(root, keep_last=2)
    for step in (1, 2, 3):
        save(svc, "job", step)
    assert [s.step for s in svc.list_steps("job")] == [2, 3]
    assert svc.arena.pool_files == 1
    lease = svc.lease("job", 0, MiB)
    assert lease.recycled


def test_a_pinned_step_outlives_eviction_until_unpinned(root: Path) -> None:
    svc = make(root, keep_last=1)
    save(svc, "job", 1)
    pin = svc.pin("job", 1)
    save(svc, "job", 2)  # retires step 1, but a reader holds it
    assert os.path.exists(pin.paths["r0"])
    with pytest.raises(StepNotFoundError):
        svc.get_step("job", 1)
    svc.unpin("job", 1, pin.pin_id)
    assert not os.path.exists(pin.paths["r0"])


def test_pressure_evicts_older_committed_steps_never_the_newest(root: Path) -> None:
    svc = make(root, capacity=3 * MiB, keep_last=5)
    save(svc, "job", 1)
    save(svc, "job", 2)
    save(svc, "job", 3)  # pool empty, 3 MiB used
    lease = svc.lease("job", 0, MiB)  # evicts step 1
    assert [s.step for s in svc.list_steps("job")] == [2, 3]
    svc.release_lease("job", lease.lease_id)
    with pytest.raises(CapacityExceededError, match=r"Raise TIERCKPT_CAPACITY"):
        svc.lease("job", 0, 3 * MiB)  # would need step 3, the newest
    assert svc.latest("job").step == 3


def test_a_new_attempt_replaces_a_stale_partial_and_a_recommit_supersedes(root: Path) -> None:
    svc = make(root)
    lease = svc.lease("job", 0, 100)
    svc.seal(
        "job",
        5,
        "old",
        SealRequest(rank=0, files=[SealFile(lease_id=lease.lease_id, name="r0", length=1)]),
    )
    save(svc, "job", 5, attempt="new")
    save(svc, "job", 5, attempt="newer")
    steps = svc.list_steps("job")
    assert [(s.step, s.state.value) for s in steps] == [(5, "committed")]
    assert len(list((root / "ns" / "job").iterdir())) == 1


def test_an_aborted_attempt_frees_its_files_now_and_a_committed_one_stays(root: Path) -> None:
    svc = make(root)
    save(svc, "job", 1)
    lease = svc.lease("job", 0, MiB)
    svc.seal(
        "job",
        2,
        "failed",
        SealRequest(rank=0, files=[SealFile(lease_id=lease.lease_id, name="r0", length=1)]),
    )
    svc.abort("job", 2, "failed")
    assert [(s.step, s.state.value) for s in svc.list_steps("job")] == [(1, "committed")]
    assert svc.arena.pool_files == 1  # the sealed file is free for the next save
    assert len(list((root / "ns" / "job").iterdir())) == 1
    with pytest.raises(StepNotFoundError, match="no save in progress with attempt a1"):
        svc.abort("job", 1, "a1")  # committed: not an attempt in progress, and it stays
    assert svc.latest("job").step == 1


def test_rebuild_keeps_committed_and_reclaims_partial(root: Path) -> None:
    svc = make(root)
    save(svc, "job", 1)
    lease = svc.lease("job", 0, MiB)
    svc.seal(
        "job",
        2,
        "x",
        SealRequest(rank=0, files=[SealFile(lease_id=lease.lease_id, name="r0", length=1)]),
    )
    svc.lease("job", 0, MiB)  # leased, never sealed
    # A new process over the same directory, as after SIGKILL.
    svc2 = make(root)
    assert [(s.step, s.state.value) for s in svc2.list_steps("job")] == [(1, "committed")]
    assert svc2.arena.pool_files == 2
    assert unpack_metadata(svc2.metadata("job", 1), where="test") == {"step": 1}
    # The partial attempt's file was cut to its sealed length (one page) at the seal.
    assert svc2.arena.used_bytes == 2 * MiB + 4096


def test_a_sealed_file_keeps_only_its_length(root: Path) -> None:
    """A rank that staged more than it writes (replicated state, issue 38) seals a shorter
    length: the file is cut to it (a page at most more), and the memory is free for others; a
    tail under 1/20 of the file stays (the file then still fits the next lease of its size)."""
    svc = make(root, capacity=4 * MiB)
    cut = svc.lease("job", 0, 2 * MiB)
    kept = svc.lease("job", 1, MiB)
    files = [
        SealFile(lease_id=cut.lease_id, name="r0", length=MiB // 2 + 1),
        SealFile(lease_id=kept.lease_id, name="r1", length=MiB - 4096),
    ]
    svc.seal("job", 1, "a", SealRequest(rank=0, files=files))
    svc.commit("job", 1, "a", CommitRequest(files=["r0", "r1"], metadata={}, world_size=2))
    sizes = {f.name: f.size for f in svc.get_step("job", 1).files}
    assert sizes == {"r0": MiB // 2 + 4096, "r1": MiB}
    step_dir = next((root / "ns" / "job").iterdir())
    assert (step_dir / "r0").stat().st_size == MiB // 2 + 4096
    assert svc.arena.used_bytes == MiB // 2 + 4096 + MiB
    assert svc.get_step("job", 1).bytes == MiB // 2 + 4096 + MiB
    svc.lease("job", 0, 2 * MiB)  # fits now: the cut tail went back to the budget
    assert make(root).get_step("job", 1).bytes == MiB // 2 + 4096 + MiB  # and after a restart


def test_rebuild_discards_a_step_with_a_missing_file(root: Path) -> None:
    svc = make(root)
    save(svc, "job", 1)
    (next((root / "ns" / "job").iterdir()) / "r0").unlink()
    svc2 = make(root)
    with pytest.raises(NamespaceNotFoundError, match="namespace job is unknown to this daemon"):
        svc2.list_steps("job")


def test_sweep_expires_unsealed_leases(root: Path) -> None:
    svc = TierService(Arena(root, 64 * MiB), keep_last=2, lease_ttl_s=0.01, spares=False)
    svc.rebuild()
    svc.lease("job", 0, MiB)
    time.sleep(0.05)
    svc.sweep()
    assert Node(svc, Restorer(svc)).status("x").leased_bytes == 0
    assert svc.arena.pool_files == 1


def test_spares_are_prefaulted_while_a_namespace_ramps_up(root: Path) -> None:
    svc = TierService(Arena(root, 64 * MiB), keep_last=2, lease_ttl_s=60, spares=True)
    svc.rebuild()
    save(svc, "job", 1, size=2 * MiB)  # fresh; a spare of the same size follows in the background
    deadline = time.monotonic() + 10
    while not svc.arena.has_pooled(2 * MiB):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert svc.lease("job", 0, 2 * MiB).recycled  # the second save finds faulted-in pages


def test_rebuild_applies_retention(root: Path) -> None:
    svc = make(root, keep_last=5)
    for step in (1, 2, 3):
        save(svc, "job", step)
    svc2 = make(root, keep_last=2)  # restarted with a smaller TIERCKPT_KEEP_LAST
    assert [s.step for s in svc2.list_steps("job")] == [2, 3]
    assert svc2.arena.pool_files == 1


def test_overwrite_false_refuses_to_replace_a_committed_step(root: Path) -> None:
    svc = make(root)
    save(svc, "job", 4, attempt="first")
    lease = svc.lease("job", 0, 100)
    svc.seal(
        "job",
        4,
        "second",
        SealRequest(rank=0, files=[SealFile(lease_id=lease.lease_id, name="r0", length=100)]),
    )
    req = CommitRequest(files=["r0"], metadata={"step": "new"}, world_size=1, overwrite=False)
    with pytest.raises(StepStateError, match=r"job/step 4 is already committed.*overwrite=False"):
        svc.commit("job", 4, "second", req)
    assert unpack_metadata(svc.metadata("job", 4), where="test") == {
        "step": 4
    }  # the committed step is untouched
    svc.commit("job", 4, "second", req.model_copy(update={"overwrite": True}))
    assert unpack_metadata(svc.metadata("job", 4), where="test") == {"step": "new"}


def test_files_fetched_for_a_step_that_leaves_memory_meanwhile_go_back_to_the_pool(
    root: Path,
) -> None:
    """A share's files are fetched into leases for a step held here; retention drops the step
    before they join it (newer saves during the fetch): the fill fails by name, and the fetched
    files are not left in ``leases/``, unaccounted, for good (the crash harness found one)."""
    svc = make(root, keep_last=2)
    save(svc, "job", 1)
    manifest = read_manifest(svc.committed_record("job", 1).manifest_path())  # type: ignore[union-attr]
    share = [FileRecord(name="r1", rank=1, length=MiB)]

    def fetch(f: FileRecord, path: str) -> None:
        with open(path, "r+b") as fh:
            fh.write(b"x" * f.length)
        save(svc, "job", 2, attempt="a2")  # two newer steps: retention drops step 1
        save(svc, "job", 3, attempt="a3")

    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        pytest.raises(StepNotFoundError, match="left this node's memory while files of it"),
    ):
        fill_step(
            svc,
            "job",
            1,
            share,
            copy_of=manifest,
            fetch=fetch,
            pool=pool,
            attempt_prefix="h",
            replicate=False,
            spanning=manifest,
        )
    assert os.listdir(root / "leases") == []
    assert svc.usage().leased_bytes == 0
    assert sorted(r.step for r in svc.committed_records("job")) == [2, 3]
    held = sum(os.path.getsize(p) for p in root.rglob("*") if p.is_file() and "ns" not in p.parts)
    assert held == svc.arena.pool_bytes  # the fetched file is in the pool, counted
