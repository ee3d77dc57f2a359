"""The tier directory cannot be turned against the host: a member of the daemon's group can write
the files there (and an earlier daemon let it create entries), so the daemon never follows a link
it finds, creates what it writes with explicit modes, and checks a request before it evicts
anything for it (issue 13, defects 1, 3, 5 and 6)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tierckpt_client import CapacityExceededError, DaemonClient
from tierckpt_core.errors import StepStateError
from tierckpt_core.protocol import CommitRequest, SealFile

from helpers import DaemonProcess, new_shm_dir


def _victim(tmp_path: Path) -> Path:
    """A directory of someone else's, with a file the daemon must never touch."""
    d = tmp_path / "victim"
    d.mkdir()
    (d / "precious").write_bytes(b"do not delete or truncate me")
    return d


def _save(c: DaemonClient, ns: str, step: int, attempt: str = "a", *, commit: bool = True) -> None:
    data = os.urandom(10_000)
    lease = c.lease(ns, 0, len(data))
    with open(lease.path, "r+b") as f:
        f.write(data)
    c.seal(ns, step, attempt, 0, [SealFile(lease_id=lease.lease_id, name="r0", length=len(data))])
    if commit:
        c.commit(ns, step, attempt, CommitRequest(files=["r0"], metadata={}, world_size=1))


def test_links_in_pool_leases_and_namespaces_are_removed_never_followed(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    with DaemonClient.from_socket(daemon.socket) as c:
        _save(c, "job", 1)
    root = daemon.shm_dir
    (root / "pool" / "planted.bin").symlink_to(victim)
    (root / "leases" / "planted.bin").symlink_to(victim / "precious")
    (root / "ns" / "planted").symlink_to(victim)
    daemon.restart()  # the rebuild walks pool/, leases/ and ns/
    assert (victim / "precious").read_bytes() == b"do not delete or truncate me"
    for link in ("pool/planted.bin", "leases/planted.bin", "ns/planted"):
        assert not os.path.lexists(root / link)
    with DaemonClient.from_socket(daemon.socket) as c:
        assert c.step("job", 1).state.value == "committed"
        _save(c, "job", 2)  # a lease after the rebuild does not pick up anything planted


def test_a_link_at_the_commit_record_temp_name_is_not_written_through(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    with DaemonClient.from_socket(daemon.socket) as c:
        _save(c, "job", 1, commit=False)
        step_dir = next((daemon.shm_dir / "ns" / "job").iterdir())
        (step_dir / "MANIFEST.json.tmp").symlink_to(victim / "precious")
        c.commit("job", 1, "a", CommitRequest(files=["r0"], metadata={}, world_size=1))
        assert c.step("job", 1).state.value == "committed"
    assert (victim / "precious").read_bytes() == b"do not delete or truncate me"


def test_a_link_in_a_superseded_attempt_is_removed_not_pooled(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    with DaemonClient.from_socket(daemon.socket) as c:
        _save(c, "job", 1, "old", commit=False)
        old_dir = next((daemon.shm_dir / "ns" / "job").iterdir())
        (old_dir / "planted").symlink_to(victim)
        _save(c, "job", 1, "new")  # a new attempt discards the unfinished one
        for step in range(2, 6):  # leases that recycle pool files
            _save(c, "job", step)
    assert (victim / "precious").read_bytes() == b"do not delete or truncate me"
    assert not any(p.is_symlink() for p in (daemon.shm_dir / "pool").iterdir())


def test_the_daemon_refuses_a_linked_lock_file_and_makes_its_socket_0660(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    shm = new_shm_dir()
    shm.mkdir()
    (shm / "daemon.lock").symlink_to(victim / "precious")
    d = DaemonProcess(shm)
    try:
        with pytest.raises(RuntimeError, match=r"daemon\.lock is a symbolic link"):
            d.start(timeout=30)
        assert (victim / "precious").read_bytes() == b"do not delete or truncate me"
        (shm / "daemon.lock").unlink()
        d.start()
        assert stat.S_IMODE(os.lstat(d.socket).st_mode) == 0o660
        for sub in ("pool", "leases", "ns"):
            assert stat.S_IMODE(os.lstat(shm / sub).st_mode) == 0o750
    finally:
        d.cleanup()


def test_a_tier_an_earlier_daemon_left_group_writable_is_closed_at_start(
    daemon: DaemonProcess,
) -> None:
    """Daemons before 0.1.x made the tier's directories 0770: any trainer of the group could
    rename its own socket over daemon.sock, or a link over a step directory. A restart takes
    the group's write permission off every directory, the tier's own with a WARNING."""
    with DaemonClient.from_socket(daemon.socket) as c:
        _save(c, "job", 1)
        _save(c, "job", 2, commit=False)  # an unfinished attempt: its directory too
    root = daemon.shm_dir
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]
    assert len(dirs) >= 6  # the tier, pool, leases, ns, ns/job, a step
    daemon.stop()
    for d in dirs:
        os.chmod(d, 0o770)
    daemon.start()
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o750
    for p in root.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            assert stat.S_IMODE(os.lstat(p).st_mode) == 0o750, p
    assert "was mode 770: made it 750" in daemon.log()
    with DaemonClient.from_socket(daemon.socket) as c:
        assert c.step("job", 1).state.value == "committed"
        _save(c, "job", 3)  # and saves go on


@pytest.mark.daemon_settings(capacity="64M")
def test_an_oversize_lease_evicts_nothing(daemon: DaemonProcess) -> None:
    with DaemonClient.from_socket(daemon.socket) as c:
        _save(c, "victimjob", 1)
        _save(c, "victimjob", 2)
        with pytest.raises(CapacityExceededError, match="so nothing was evicted"):
            c.lease("other", 0, 1 << 44)
        assert [s.step for s in c.steps("victimjob")] == [1, 2]


def test_resealing_a_committed_attempt_is_a_clear_409(daemon: DaemonProcess) -> None:
    with DaemonClient.from_socket(daemon.socket) as c:
        _save(c, "job", 1)
        with pytest.raises(StepStateError, match="attempt a is already committed"):
            c.seal("job", 1, "a", 0, [])
        assert c.status().used_bytes > 0  # the daemon answered, and keeps answering


def test_a_deleted_step_stays_deleted_across_a_restart_even_while_pinned(
    daemon: DaemonProcess,
) -> None:
    with DaemonClient.from_socket(daemon.socket) as c:
        _save(c, "job", 1)
        _save(c, "job", 2)
        pin = c.pin("job", 2)
        c.delete("job", 2)
        assert c.latest("job").step == 1
        assert os.path.exists(pin.paths["r0"])  # the reader still reads it
    daemon.restart()
    with DaemonClient.from_socket(daemon.socket) as c:
        assert c.latest("job").step == 1
        assert [s.step for s in c.steps("job")] == [1]


def test_a_seal_moves_only_the_leased_file_never_what_replaced_it(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    with DaemonClient.from_socket(daemon.socket) as c:
        lease = c.lease("job", 0, 4096)
        os.unlink(lease.path)
        os.symlink(victim / "precious", lease.path)
        with pytest.raises(StepStateError, match="replaced by something other than a regular"):
            c.seal("job", 1, "a", 0, [SealFile(lease_id=lease.lease_id, name="r0", length=10)])
        _save(c, "job", 2)  # the daemon answers on, and saves go on
    assert (victim / "precious").read_bytes() == b"do not delete or truncate me"
    assert not any(p.is_symlink() for p in daemon.shm_dir.rglob("*") if p.name == "r0")
