"""The persistent tier: uploads in the daemon, restore after a node loss, integrity, resume."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from seaweed import SeaweedS3
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client import DaemonClient, DaemonUnavailableError
from tierckpt_client.dcp import TieredStorageWriter
from tierckpt_core.layout import newest_durable_steps
from tierckpt_core.objectstore import StoreSettings, open_store

from helpers import DaemonProcess
from kit import blank_like, load, save, seeded_state, wait_durable

N = 1 << 16


# What each step saves: kit.seeded_state(step, **LAYOUT).
LAYOUT: dict[str, Any] = {"numel": N, "more": {"b": ((33,), torch.float32)}}


def _assert_state(out: dict[str, object], step: int) -> None:
    ref = seeded_state(step, **LAYOUT)
    assert torch.equal(out["w"], ref["w"]) and torch.equal(out["b"], ref["b"])
    assert out["meta"] == {"step": step}


def _reboot(node: DaemonProcess) -> None:
    """A node that lost its memory: kill the daemon, wipe the tmpfs tier, start again."""
    node.kill()
    shutil.rmtree(node.shm_dir)
    node.start()


def test_durable_steps_restore_after_node_loss(node: DaemonProcess) -> None:
    save("job", 10, seeded_state(10, **LAYOUT))
    save("job", 20, seeded_state(20, **LAYOUT), staged=False)
    wait_durable("job", {10, 20})
    with DaemonClient() as c:
        saved = {s.step: (s.created_at, s.committed_at) for s in c.steps("job")}
    _reboot(node)
    with DaemonClient() as c:
        assert [(x.step, x.in_memory, x.durable) for x in c.candidates("job")] == [
            (20, False, True),
            (10, False, True),
        ]
    step, out = load("job", blank_like(seeded_state(0, **LAYOUT)))
    assert step == 20
    _assert_state(out, 20)
    step, out = load("job", blank_like(seeded_state(0, **LAYOUT)), 10)
    _assert_state(out, 10)
    with DaemonClient() as c:
        steps = c.steps("job")
    assert {s.step: s.state.value for s in steps} == {10: "durable", 20: "durable"}
    # A copy is no new save: the steps keep the times they were saved at, and the log says so.
    assert {s.step: (s.created_at, s.committed_at) for s in steps} == saved
    log = node.log_path.read_text()
    assert "job/step 20 copied into memory (committed " in log
    assert log.count("job/step 20 committed") == 1  # the save's, before the reboot


def test_an_older_durable_step_stays_hydrated_until_its_reader_is_done(node: DaemonProcess) -> None:
    """Retention (keep_last=2) must not evict a step the moment it is hydrated for a reader."""
    for step in (10, 20, 30):
        save("job", step, seeded_state(step, **LAYOUT))
        wait_durable("job", {step})
    with DaemonClient() as c:
        assert sorted(s.step for s in c.steps("job") if s.in_memory) == [20, 30]
        assert {x.step for x in c.candidates("job") if x.durable} == {10, 20, 30}
    step, out = load("job", blank_like(seeded_state(0, **LAYOUT)), 10)
    assert step == 10
    _assert_state(out, 10)
    save(
        "job", 40, seeded_state(40, **LAYOUT)
    )  # the next commit applies retention again: step 10 leaves memory
    with DaemonClient() as c:
        assert sorted(s.step for s in c.steps("job") if s.in_memory) == [30, 40]


def test_corrupt_object_falls_back_to_older_step(
    node: DaemonProcess, tier_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    save("job", 10, seeded_state(10, **LAYOUT))
    save("job", 20, seeded_state(20, **LAYOUT))
    wait_durable("job", {10, 20})
    store = open_store(tier_url, StoreSettings.from_env())
    key = next(o.key for o in store.list("job/step_000000000020/") if o.key.endswith(".data"))
    data = bytearray(store.get_bytes(key))
    data[100] ^= 0xFF
    store.put_bytes(key, bytes(data))
    _reboot(node)
    with caplog.at_level(logging.WARNING, logger="tierckpt_client.dcp.reader"):
        step, out = load("job", blank_like(seeded_state(0, **LAYOUT)))
    assert step == 10
    _assert_state(out, 10)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipping step 20" in warnings[0] and "corrupt" in warnings[0]
    with pytest.raises(CheckpointException, match=r"file r00000\.data .* is corrupt"):
        load("job", blank_like(seeded_state(0, **LAYOUT)), 20)


def test_latest_looks_up_only_the_newest_durable_steps_and_walks_on_past_corrupt_ones(
    node: DaemonProcess, tier_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A load of "latest" is offered the newest two durable steps (the step directories listed,
    then their markers newest first: not every object of the namespace), and asks again below
    them when both are corrupt, newest first (never an older step in memory before the durable
    ones between); `candidates` without `read` still lists every durable step."""
    for step in (10, 20, 30, 40):
        save("walk", step, seeded_state(step, **LAYOUT))
        wait_durable("walk", {step})  # (memory keeps the last two)
    store = open_store(tier_url, StoreSettings.from_env())
    store.put_bytes("walk/step_000000000050/r00000.data", b"an upload under way")  # no marker
    assert store.list_dirs("walk/") == [f"step_0000000000{s}" for s in (10, 20, 30, 40, 50)]
    assert newest_durable_steps(store, "walk") == ([40, 30], True)
    assert newest_durable_steps(store, "walk", below=30) == ([20, 10], False)
    assert newest_durable_steps(store, "walk", below=10) == ([], False)
    for step in (30, 40):  # corrupt in the persistent tier
        key = next(
            o.key for o in store.list(f"walk/step_0000000000{step}/") if o.key.endswith(".data")
        )
        data = bytearray(store.get_bytes(key))
        data[100] ^= 0xFF
        store.put_bytes(key, bytes(data))
    _reboot(node)
    save("walk", 5, seeded_state(5, **LAYOUT))  # in memory, older than every durable step
    wait_durable("walk", {5})
    with DaemonClient() as c:
        assert {x.step for x in c.candidates("walk") if x.durable} == {5, 10, 20, 30, 40}
        first = c.candidates_read("walk")
        assert [x.step for x in first.candidates] == [40, 30] and first.next_below == 30
        then = c.candidates_read("walk", 30)
        assert [x.step for x in then.candidates] == [20, 10] and then.next_below == 10
        last = c.candidates_read("walk", 10)
        assert [(x.step, x.in_memory) for x in last.candidates] == [(5, True)]
        assert last.next_below is None
    with caplog.at_level(logging.WARNING, logger="tierckpt_client.dcp.reader"):
        step, out = load("walk", blank_like(seeded_state(0, **LAYOUT)))
    assert step == 20
    _assert_state(out, 20)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("skipping step 40" in w and "corrupt" in w for w in warnings), warnings
    assert any("skipping step 30" in w and "corrupt" in w for w in warnings), warnings


def test_overwrite_false_refuses_a_step_that_is_only_durable(node: DaemonProcess) -> None:
    for step in (10, 20, 30):
        save("kept", step, seeded_state(step, **LAYOUT))
        wait_durable("kept", {step})  # (memory keeps the last two: step 10 only durable)
    with pytest.raises(CheckpointException, match=r"kept/step 10 .*overwrite=False"):
        save("kept", 10, seeded_state(99, **LAYOUT), overwrite=False)
    save("kept", 15, seeded_state(15, **LAYOUT), overwrite=False)  # a new step is saved
    step, out = load("kept", blank_like(seeded_state(0, **LAYOUT)), 10)
    _assert_state(out, 10)


def test_upload_failure_is_reported_and_resumes_after_restart(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    root = tmp_path / "store"
    root.mkdir()
    (root / "job").write_text("a file where the namespace directory must go")
    d = make_node(client=True, persist_url=f"file://{root}")
    save("job", 5, seeded_state(5, **LAYOUT))
    with DaemonClient() as c:
        deadline = time.monotonic() + 30
        while (st := c.status().persistent) is None or st.failed_uploads == 0:
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        assert st.healthy is False and "job/step 5: upload to file://" in (st.last_error or "")
        assert [s.state.value for s in c.steps("job")] == ["committed"]
    # The memory tier keeps working while the persistent tier is broken.
    _step, out = load("job", blank_like(seeded_state(0, **LAYOUT)))
    _assert_state(out, 5)

    d.kill()  # SIGKILL with the upload still pending
    (root / "job").unlink()
    d.start()
    wait_durable("job", {5})
    store = open_store(f"file://{root}")
    names = {o.key for o in store.list("job/")}
    assert names == {
        "job/step_000000000005/r00000.data",
        "job/step_000000000005/r00000.extra",
        "job/step_000000000005/manifest.json",
        "job/step_000000000005/COMMITTED",
    }


def test_without_a_daemon_restore_and_save_use_the_tier_directly(
    node: DaemonProcess,
    tier_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    save("job", 10, seeded_state(10, **LAYOUT))
    wait_durable("job", {10})
    node.kill()
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", tier_url)

    with caplog.at_level(logging.WARNING):
        step, out = load("job", blank_like(seeded_state(0, **LAYOUT)))
        save(
            "job", 20, seeded_state(20, **LAYOUT)
        )  # async_save: stages privately, uploads in write_data
        save("job", 30, seeded_state(30, **LAYOUT), staged=False)
    assert step == 10
    _assert_state(out, 10)
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("restoring straight from the persistent tier" in m for m in msgs)
    assert sum("saving straight to the persistent tier" in m for m in msgs) == 1  # said once
    step, out = load("job", blank_like(seeded_state(0, **LAYOUT)), 20)
    _assert_state(out, 20)

    # The daemon comes back (empty memory): the degraded saves are ordinary durable steps to it.
    shutil.rmtree(node.shm_dir)
    node.start()
    step, out = load("job", blank_like(seeded_state(0, **LAYOUT)))
    assert step == 30
    _assert_state(out, 30)


def test_degraded_save_can_be_refused(node: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    node.kill()
    with pytest.raises(DaemonUnavailableError, match="set TIERCKPT_PERSIST_URL in the trainer"):
        dcp.async_save(
            seeded_state(1, **LAYOUT), storage_writer=TieredStorageWriter("job", 1), no_dist=True
        )
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", "file:///nonexistent-but-unused")
    writer = TieredStorageWriter("job", 1, on_unavailable="raise")
    with pytest.raises(DaemonUnavailableError, match="cannot reach the tierckpt daemon"):
        dcp.async_save(seeded_state(1, **LAYOUT), storage_writer=writer, no_dist=True)


def test_export_loads_with_torch_filesystem_reader(node: DaemonProcess, tmp_path: Path) -> None:
    save("job", 10, seeded_state(10, **LAYOUT), staged=False)
    wait_durable("job", {10})
    _reboot(node)  # export from the persistent tier, through the daemon's hydration
    dest = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, "-m", "tierckpt_client.cli", "export", "job", "latest", str(dest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "exported job step 10" in proc.stdout
    out = blank_like(seeded_state(0, **LAYOUT))
    dcp.load(out, storage_reader=FileSystemReader(dest), no_dist=True)
    _assert_state(out, 10)
    again = subprocess.run(
        [sys.executable, "-m", "tierckpt_client.cli", "export", "job", "10", str(dest)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 1 and "already holds a DCP checkpoint" in again.stderr


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("AWS_SECRET_ACCESS_KEY", "not-the-secret", "credentials"),
        ("bucket", "no-such-bucket", "no-such-bucket"),
    ],
)
def test_bad_s3_settings_are_reported_and_memory_keeps_working(
    s3_env: SeaweedS3,
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    value: str,
    message: str,
    make_node: Callable[..., DaemonProcess],
) -> None:
    bucket = value if setting == "bucket" else s3_env.bucket
    if setting != "bucket":
        monkeypatch.setenv(setting, value)
    d = make_node(client=True, persist_url=f"s3://{bucket}/x")
    with DaemonClient() as c:
        deadline = time.monotonic() + 60
        while (st := c.status().persistent) is None or st.healthy is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert st.healthy is False and message in (st.last_error or ""), st
    assert message in d.log()
    save("job", 1, seeded_state(1, **LAYOUT))
    step, out = load("job", blank_like(seeded_state(0, **LAYOUT)))
    assert step == 1
    _assert_state(out, 1)


def test_persistent_retention_keeps_newest_and_collects_incomplete(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    root = tmp_path / "store"
    d = make_node(client=True, start=False, persist_url=f"file://{root}", persist_keep_last=2)
    store = open_store(f"file://{root}")
    store.put_bytes("job/step_000000000001/r00000.data", b"an upload that never finished")
    d.start()
    for step in (2, 3, 4):
        save("job", step, seeded_state(step, **LAYOUT))
        wait_durable("job", {step})
    # Retention runs right after a step is marked durable: give it a moment.
    want = {"step_000000000003", "step_000000000004"}
    deadline = time.monotonic() + 30
    while (keys := {o.key.split("/")[1] for o in store.list("job/")}) != want:
        assert time.monotonic() < deadline, keys
        time.sleep(0.05)


def _thread_nices(pid: int) -> list[int]:
    """The niceness of every thread of process ``pid`` (field 19 of /proc/<pid>/task/*/stat)."""
    nices = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        nices.append(int(fields[16]))
    return nices


@pytest.mark.parametrize("nice", [7, 0])
def test_transfer_threads_yield_the_cpu_to_training(
    nice: int, tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    d = make_node(client=True, persist_url=f"file://{tmp_path / 'store'}", background_nice=nice)
    save("nice", 1, seeded_state(1, **LAYOUT))
    wait_durable("nice", {1})
    assert d.proc is not None
    nices = _thread_nices(d.proc.pid)
    # The thread that answers the trainers keeps the priority the daemon started with (this
    # test's own: pytest may run niced); the uploader's are lowered to `nice`, never raised.
    base = os.getpriority(os.PRIO_PROCESS, 0)
    background = max(base, nice)
    assert base in nices
    assert (nices.count(background) >= 2) if background != base else set(nices) == {base}


def test_every_step_queued_for_upload_is_uploaded_or_reported_skipped(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """Uploads slower than the saves, keep_last=2: a queued step that retention takes out of memory
    before its upload starts is not uploaded, and says so (log line, metric, status)."""
    d = make_node(
        client=True,
        persist_url=f"file://{tmp_path / 'store'}",
        keep_last=2,
        # ~16 s per step of ~260 KiB. Saves go on until one queued step was skipped (three
        # saves during one upload), so a loaded machine whose saves are slow only saves more.
        upload_max_rate="16K",
    )
    steps: list[int] = []
    with DaemonClient() as c:
        for step in range(0, 120, 10):
            save("job", step, seeded_state(step, **LAYOUT))
            steps.append(step)
            p = c.status().persistent
            assert p is not None
            if p.skipped_uploads:
                break
        deadline = time.monotonic() + 180
        while (p := c.status().persistent) is not None and (p.queued_steps or p.uploads):
            assert time.monotonic() < deadline, p
            time.sleep(0.1)
        assert p is not None
        durable = {x.step for x in c.candidates("job") if x.durable}
    skipped = set(steps) - durable
    assert steps[-1] in durable and skipped, (steps, durable, "uploads kept pace with saves")
    assert p.skipped_uploads == len(skipped)
    log = d.log()
    for step in skipped:
        assert f"job/step {step} is not uploaded: it left memory first: retention" in log
