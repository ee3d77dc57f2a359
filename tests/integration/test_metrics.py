"""/metrics on the TCP port parses as Prometheus text and moves when a save happens; the build
info, the per-namespace "seconds since" gauges and the replication skips say what a user would
want to alert on."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp
from prometheus_client.parser import text_string_to_metric_families

import tierckpt_daemon
from tierckpt_client import CapacityExceededError, DaemonClient
from tierckpt_client.dcp import TieredStorageWriter
from tierckpt_core.protocol import CommitRequest, SealFile
from tierckpt_daemon.metrics import namespace_label

from helpers import DaemonProcess, free_port, started, wait_until
from kit import save, seeded_state

N = 1 << 14

PORT = free_port()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.mark.daemon_settings(port=PORT, host="127.0.0.1", capacity="64M")
def test_metrics_move_with_a_save(client_env: DaemonProcess) -> None:
    before = _scrape(PORT)
    assert before[("tierckpt_capacity_bytes", ())] == 64 << 20
    assert before[("tierckpt_commits_total", ())] == 0
    sd = {"w": torch.randn(1 << 18), "extra": {"epoch": 1}}
    dcp.async_save(sd, storage_writer=TieredStorageWriter("m", 1), no_dist=True).result()
    after = _scrape(PORT)
    assert after[("tierckpt_commits_total", ())] == 1
    assert after[("tierckpt_leases_total", (("recycled", "false"),))] >= 1
    assert after[("tierckpt_memory_bytes", (("state", "committed"),))] >= 1 << 20
    assert after[("tierckpt_steps", (("state", "committed"),))] == 1
    assert after[("tierckpt_lease_seconds_count", ())] >= 1
    # The local API stays off the TCP port.
    assert httpx.get(f"http://127.0.0.1:{PORT}/v1/status", timeout=10).status_code == 403


@pytest.mark.daemon_settings(port=PORT, host="127.0.0.1", capacity="64M")
def test_build_info_names_the_versions_that_run(client_env: DaemonProcess) -> None:
    infos = [
        dict(labels) for (name, labels), v in _scrape(PORT).items() if name == "tierckpt_build_info"
    ]
    assert infos == [
        {
            "version": tierckpt_daemon.__version__,
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
        }
    ]
    assert _scrape(PORT)[("tierckpt_build_info", tuple(sorted(infos[0].items())))] == 1
    assert torch.__version__.split("+")[0] in infos[0]["torch"]


def test_seconds_since_the_last_committed_and_durable_step_per_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_node: Callable[..., DaemonProcess]
) -> None:
    port = free_port()
    d = make_node(
        start=False,
        port=port,
        host="127.0.0.1",
        capacity="64M",
        persist_url=(tmp_path / "tier").as_uri(),
        metrics_namespace_labels="plain",  # the names themselves, for readable keys below
    )
    since_commit = "tierckpt_seconds_since_committed_step"
    since_durable = "tierckpt_seconds_since_durable_step"
    d.start()
    monkeypatch.setenv("TIERCKPT_SOCKET", str(d.socket))
    # No series before a first step: "absent" rather than a made-up age.
    assert not [k for k in _scrape(port) if k[0] in (since_commit, since_durable)]

    save("kept", 1, seeded_state(1, N), persist=False)  # committed, never made durable
    save("safe", 1, seeded_state(1, N), persist=True)
    wait_until(
        "safe/step 1 durable",
        lambda: (since_durable, (("namespace", "safe"),)) in _scrape(port),
    )
    first = _scrape(port)
    assert 0 <= first[(since_commit, (("namespace", "kept"),))] < 600
    assert 0 <= first[(since_commit, (("namespace", "safe"),))] < 600
    assert 0 <= first[(since_durable, (("namespace", "safe"),))] < 600
    assert (since_durable, (("namespace", "kept"),)) not in first
    # Computed at scrape time: the age grows while nothing is saved.
    time.sleep(1.1)
    later = _scrape(port)
    for key in [
        (since_commit, (("namespace", "kept"),)),
        (since_durable, (("namespace", "safe"),)),
    ]:
        assert later[key] >= first[key] + 1.0, key
    # A restarted daemon takes the times from the commit records it still holds.
    d.restart()
    again = _scrape(port)
    for key in [
        (since_commit, (("namespace", "kept"),)),
        (since_commit, (("namespace", "safe"),)),
        (since_durable, (("namespace", "safe"),)),
    ]:
        assert later[key] <= again[key] < later[key] + 600, key
    assert (since_durable, (("namespace", "kept"),)) not in again
    # A step brought back from the persistent tier for a reader is not progress of the job:
    # it resets neither age.
    with DaemonClient.from_socket(d.socket) as c:
        c.delete("safe", 1)
        assert c.hydrate("safe", 1).state.value == "durable"
    hydrated = _scrape(port)
    for key in [
        (since_commit, (("namespace", "safe"),)),
        (since_durable, (("namespace", "safe"),)),
    ]:
        assert hydrated[key] >= again[key], key
    # Nor when the times are taken from the steps in memory at a start: the only step of
    # `safe` left in memory was hydrated, so there is no commit time to take (absent, never a
    # made-up young age); `kept` still has its own.
    d.restart()
    restarted = _scrape(port)
    assert (since_commit, (("namespace", "safe"),)) not in restarted
    assert (since_durable, (("namespace", "safe"),)) not in restarted
    assert (since_commit, (("namespace", "kept"),)) in restarted
    # A new commit resets the namespace's age.
    save("kept", 2, seeded_state(2, N), persist=False)
    assert (
        _scrape(port)[(since_commit, (("namespace", "kept"),))]
        < later[(since_commit, (("namespace", "kept"),))]
    )


@pytest.mark.parametrize("labels", ["hashed", "plain", "off", None])
def test_metrics_show_namespace_names_only_when_told(
    labels: str | None, monkeypatch: pytest.MonkeyPatch, make_node: Callable[..., DaemonProcess]
) -> None:
    """/metrics needs no token: by default a job's namespace shows as a short hash of its name,
    the same on every node (dashboards group by it); ``plain`` shows the name, ``off`` none."""
    port = free_port()
    settings = {"metrics_namespace_labels": labels} if labels is not None else {}
    d = make_node(start=False, port=port, host="127.0.0.1", capacity="64M", **settings)
    name = "acme-secret-finetune"
    since_commit = "tierckpt_seconds_since_committed_step"
    d.start()
    monkeypatch.setenv("TIERCKPT_SOCKET", str(d.socket))
    save(name, 1, seeded_state(1, N), persist=False)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    series = {k[1] for k in _scrape(port) if k[0] == since_commit}
    if labels == "plain":
        assert series == {(("namespace", name),)}
    elif labels == "off":
        assert series == set() and name not in text
    else:  # hashed, the default
        assert name not in text
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        assert series == {(("namespace", digest),)} and namespace_label(name) == digest


def test_replication_skips_are_counted_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, make_node: Callable[..., DaemonProcess]
) -> None:
    port, dead = free_port(), free_port()  # nothing listens on `dead`: every push fails
    me = f"127.0.0.1:{port}"
    d = make_node(
        start=False,
        port=port,
        host="127.0.0.1",
        capacity="64M",
        node_name=me,
        peers=f"{me},127.0.0.1:{dead}",
        peer_token="peer-token-for-the-metrics-test-0123",
    )
    skips = "tierckpt_replication_skips_total"
    d.start()
    monkeypatch.setenv("TIERCKPT_SOCKET", str(d.socket))
    save("m", 1, seeded_state(1, N))
    # Its pushes fail and are retried; a new save of the step replaces it meanwhile.
    wait_until(
        "a failed push",
        lambda: _scrape(port).get(("tierckpt_replication_failures_total", ())),
    )
    save("m", 1, seeded_state(1, N))
    got = wait_until("the skip", lambda: _scrape(port).get((skips, (("reason", "superseded"),))))
    assert got == 1
    status = d.status()
    assert status is not None and status["replication"]["skipped_steps"] == 1
    assert "m/step 1 is not replicated: a newer save of the same step replaced it" in d.log()


def test_a_step_with_no_peer_to_go_to_is_counted_as_skipped(
    monkeypatch: pytest.MonkeyPatch, make_node: Callable[..., DaemonProcess]
) -> None:
    port = free_port()
    me = f"127.0.0.1:{port}"
    d = make_node(
        port=port,
        host="127.0.0.1",
        capacity="64M",
        node_name=me,
        peers=me,  # a ring of one: nobody to replicate to
        peer_token="peer-token-for-the-metrics-test-0123",
    )
    monkeypatch.setenv("TIERCKPT_SOCKET", str(d.socket))
    save("m", 1, seeded_state(1, N))
    save("m", 2, seeded_state(2, N))
    got = wait_until(
        "the skips",
        lambda: (
            _scrape(port).get(("tierckpt_replication_skips_total", (("reason", "no_peers"),))) == 2
        ),
    )
    assert got
    # Said once, at WARNING, not once per step.
    assert d.log().count("is not replicated: no other daemon is a member") == 1


def _documented_metrics() -> set[str]:
    """The metric names in docs/operations.md's table under "Metrics and dashboards"."""
    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    table = doc.split("| metric | type | what |", 1)[1].split("\n\n", 1)[0]
    return {
        re.sub(r"\{.*", "", name)
        for row in table.splitlines()
        if row.startswith("|")
        for name in re.findall(
            r"`((?:tierckpt|process)_[a-z_*]+(?:\{[a-z_,]*\})?)`", row.split("|")[1]
        )
    }


@pytest.mark.daemon_settings(port=PORT, host="127.0.0.1", capacity="64M")
def test_every_exported_metric_is_in_the_docs_table_and_no_created_series(
    client_env: DaemonProcess,
) -> None:
    text = httpx.get(f"http://127.0.0.1:{PORT}/metrics", timeout=10).text
    families = list(text_string_to_metric_families(text))
    exported = {
        f.name + ("_total" if f.type == "counter" else "")
        for f in families
        if f.name.startswith("tierckpt_")
    }
    documented = _documented_metrics()
    assert exported - documented == set(), "exported but not in docs/operations.md's table"
    assert documented - exported - {"process_*"} == set(), "documented but not exported"
    assert not [s.name for f in families for s in f.samples if s.name.endswith("_created")]
    # The process's own: resident memory, open descriptors, CPU seconds.
    names = {f.name for f in families}
    assert {"process_resident_memory_bytes", "process_open_fds", "process_cpu_seconds"} <= names
    assert "process_*" in documented


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_a_lease_the_tmpfs_cannot_hold_counts_as_a_capacity_rejection(tmp_path: Path) -> None:
    """A tmpfs smaller than TIERCKPT_CAPACITY refuses a lease with ENOSPC: the save's error
    says so, and TierckptCapacityRejections must see it as it sees a lease over the budget (the
    counter stayed 0)."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(small)], check=True)
    port = free_port()
    d = DaemonProcess(small / "tier", capacity="64M", port=port, host="127.0.0.1")
    try:
        d.start()
        with (
            DaemonClient.from_socket(d.socket) as c,
            pytest.raises(CapacityExceededError, match="the tmpfs is smaller"),
        ):
            c.lease("job", 0, 16 << 20)
        assert _scrape(port)[("tierckpt_capacity_rejections_total", ())] == 1
    finally:
        d.stop()
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_damaged_commit_record_found_at_a_restart_is_reported_as_corruption() -> None:
    """A committed step whose MANIFEST.json was cut short: at a restart its files were dropped
    with a WARNING and an INFO "reclaimed 1 files of unfinished save", and no alert. Its files
    cannot be verified without it (so they still go), but it is said as corruption, counted for
    TierckptVerificationFailures."""
    port = free_port()
    with started(port=port, host="127.0.0.1", log_level="INFO") as d:
        with DaemonClient.from_socket(d.socket) as c:
            for step in (1, 2):
                lease = c.lease("job", 0, 4096)
                with open(lease.path, "r+b") as f:
                    f.write(b"x" * 4096)
                c.seal(
                    "job", step, "a", 0, [SealFile(lease_id=lease.lease_id, name="d", length=4096)]
                )
                c.commit("job", step, "a", CommitRequest(files=["d"], metadata={}, world_size=1))
        (record,) = (d.shm_dir / "ns" / "job").glob("000000000001-*/MANIFEST.json")
        record.write_bytes(record.read_bytes()[:40])
        d.restart()
        assert _scrape(port)[("tierckpt_verification_failures_total", (("tier", "memory"),))] == 1
        log = d.log_path.read_text()
        assert "the commit record of this committed step is damaged" in log, log[-3000:]
        assert "unfinished save" not in log
        with DaemonClient.from_socket(d.socket) as c:
            assert [s.step for s in c.steps("job")] == [2]
