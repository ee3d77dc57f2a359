"""Failures that used to be silent reach the operator (issue 33): a background thread that dies,
and corruption a reader finds. Each shows in ``tierckpt status``, in ``/metrics`` (where the
chart's alerts look) and in the daemon's log, while the memory tier keeps serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_core.protocol import CorruptionReport

from helpers import DaemonProcess, free_port, new_shm_dir, wait_until
from kit import blank_state, cli, flip_byte, load, save, seeded_state, step_paths, wait_durable

N = 1 << 16

# A daemon whose uploader meets an error nobody foresaw: its first health check raises.
_BROKEN_UPLOADER = """
import sys
from tierckpt_core.objectstore.file import FileStore

def health(self):
    raise RuntimeError("injected: an error no handler expects")

FileStore.health = health
from tierckpt_daemon.__main__ import main
sys.exit(main())
"""


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_a_background_thread_that_dies_is_seen_and_latest_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm, port = new_shm_dir(), free_port()
    log = tmp_path / "daemon.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCKPT_")}
    env.update(
        TIERCKPT_SHM_DIR=str(shm),
        TIERCKPT_PORT=str(port),
        TIERCKPT_CAPACITY="256M",
        TIERCKPT_PERSIST_URL=f"file://{tmp_path}/store",
        TIERCKPT_LOG_JSON="1",
    )
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BROKEN_UPLOADER], env=env, stdout=out, stderr=out
        )
    socket = shm / "daemon.sock"
    try:
        client = DaemonClient(ClientConfig(socket=socket, connect_timeout_s=1.0))
        wait_until(
            "the daemon reports its dead uploader",
            lambda: client.ping() and client.status().failed_threads,
            describe=log.read_text,
        )
        st = client.status()
        assert st.persistent is not None and st.persistent.healthy is False
        assert "uploader thread" in (st.persistent.last_error or "")
        assert "RuntimeError: injected" in st.failed_threads[0]
        status = cli("status", node=socket, timeout=120)
        assert "UNHEALTHY" in status.stdout and "injected" in status.stdout, status.stdout

        metrics = _scrape(port)
        assert metrics[("tierckpt_persistent_healthy", ())] == 0
        died = ("tierckpt_background_thread_failures_total", (("thread", "tierckpt-persister"),))
        assert metrics[died] == 1
        # The traceback is one JSON log line, not raw text on stderr.
        records = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]
        dead = [r for r in records if r.get("thread_name") == "tierckpt-persister"]
        assert dead and dead[0]["level"] == "ERROR" and "Traceback" in dead[0]["exc"]
        assert not any(ln.startswith("Traceback") for ln in log.read_text().splitlines())

        # The memory tier serves on: a save, and "latest" loaded from memory.
        monkeypatch.setenv("TIERCKPT_SOCKET", str(socket))
        save("job", 1, seeded_state(1, N), staged=False)
        step, out = load("job", blank_state(N))
        assert step == 1 and torch.equal(out["w"], seeded_state(1, N)["w"])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        subprocess.run(["rm", "-rf", str(shm)], check=True)


def test_corruption_a_reader_finds_is_counted_and_logged_by_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    d = DaemonProcess(new_shm_dir(), port=port, capacity="256M", log_json=1)
    try:
        d.start()
        monkeypatch.setenv("TIERCKPT_SOCKET", str(d.socket))
        save("job", 1, seeded_state(1, N), staged=False)
        save("job", 2, seeded_state(2, N), staged=False)
        failures = ("tierckpt_verification_failures_total", (("tier", "memory"),))
        assert _scrape(port)[failures] == 0  # the series exists before the first: increase() works
        data = max(step_paths("job", 2).values(), key=os.path.getsize)  # the tensor's file
        flip_byte(data, 5000)

        # A trainer's load of "latest" falls back past step 2; the daemon hears of it.
        step, out = load("job", blank_state(N))
        assert step == 1 and torch.equal(out["w"], seeded_state(1, N)["w"])
        assert _scrape(port)[failures] == 1
        records = [json.loads(ln) for ln in d.log_path.read_text().splitlines() if ln[:1] == "{"]
        found = [r for r in records if r.get("tier") == "memory" and r.get("step") == 2]
        assert found, d.log()
        assert found[0]["level"] == "ERROR" and found[0]["namespace"] == "job"
        assert found[0]["file"] == Path(data).name and found[0]["block"] == 0

        # tierckpt verify finds it too, and says so to the daemon.
        verify = cli("verify", "job", "2", node=d, timeout=120)
        assert verify.returncode != 0 and "CORRUPT" in verify.stdout, verify.stdout
        assert _scrape(port)[failures] == 2
    finally:
        d.lose_node()
        d.log_path.unlink(missing_ok=True)


def test_a_report_to_a_daemon_that_is_gone_does_not_slow_or_fail_anything() -> None:
    client = DaemonClient(ClientConfig(socket=Path("/nonexistent/daemon.sock")))
    t0 = time.monotonic()
    client.report_corruption("job", 1, CorruptionReport(tier="memory", file="x.data"))
    assert time.monotonic() - t0 < 1.0


def _a_step_behind_once_then_the_step(ns: str) -> None:
    """A restore of ``ns`` falls back past its damaged step 2 once, the daemon drops that memory
    copy, and the next restore reads step 2 from elsewhere (the persistent tier), bit-exact."""
    step, out = load(ns, blank_state(N))
    assert step == 1 and torch.equal(out["w"], seeded_state(1, N)["w"])
    with DaemonClient() as c:
        wait_until(
            "step 2's memory copy dropped",
            lambda: 2 not in [s.step for s in c.steps(ns)],
            timeout=30,
        )
    step, out = load(ns, blank_state(N))
    assert step == 2 and torch.equal(out["w"], seeded_state(2, N)["w"])


def test_a_durable_steps_damaged_memory_copy_is_dropped_and_read_from_the_tier_next(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """A reader that finds a durable step corrupt in memory falls back past it once; the daemon
    checks the file itself and drops that memory copy, so the next "latest" is the step again,
    read verified from the persistent tier (before: every restore came back a step behind until
    someone ran ``tierckpt rm``). A damaged step that is nowhere else keeps its memory copy."""
    d = make_node(client=True, persist_url=f"file://{tmp_path / 'store'}", log_json=1)
    for step in (1, 2):
        save("heal", step, seeded_state(step, N), persist=True)
    wait_durable("heal", {1, 2})
    save("only", 1, seeded_state(1, N), persist=False)
    save("only", 2, seeded_state(2, N), persist=False)
    for ns in ("heal", "only"):
        flip_byte(max(step_paths(ns, 2).values(), key=os.path.getsize), 5000)

    _a_step_behind_once_then_the_step("heal")

    step, _ = load("only", blank_state(N))
    assert step == 1
    # A report the daemon cannot confirm (step 1 is intact) removes nothing either.
    intact = next(n for n in step_paths("heal", 1) if n.endswith(".data"))
    with DaemonClient() as c:
        c.report_corruption("heal", 1, CorruptionReport(file=intact, tier="memory"))
    wait_until(
        "the daemon's checks of both",
        lambda: (
            "the step is nowhere else" in (log := d.log())
            and "matches its checksum here: its memory copy is kept" in log
        ),
    )
    with DaemonClient() as c:
        assert [s.step for s in c.steps("only")] == [1, 2]
        assert [s.step for s in c.steps("heal")] == [1, 2]  # (2: read back in from the tier)


def test_a_durable_steps_damaged_commit_record_in_memory_is_dropped_too(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """A durable step whose commit record in memory no longer decodes is skipped by "latest"
    once; the daemon checks the record itself and drops the memory copy, and the next restore
    reads the step from the persistent tier."""
    make_node(client=True, persist_url=f"file://{tmp_path / 'store'}")
    for step in (1, 2):
        save("rec", step, seeded_state(step, N), persist=True)
    wait_durable("rec", {1, 2})
    record = Path(next(iter(step_paths("rec", 2).values()))).parent / "MANIFEST.json"
    text = record.read_text()
    at = text.index('"metadata":"zlib+b64:') + 40
    record.write_text(text[:at] + ("A" if text[at] != "A" else "B") + text[at + 1 :])

    _a_step_behind_once_then_the_step("rec")
