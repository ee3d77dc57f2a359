"""The ``tierckpt`` CLI against a real daemon holding steps that a real ``dcp.save`` created."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from s3proxy import S3FaultProxy
from seaweed import SeaweedS3

from tierckpt_client import DaemonClient

from helpers import DaemonProcess
from kit import CLI, cli, cli_json, flip_byte, save, seeded_state

N = 64 * 1024  # 256 KiB of float32 per step


def test_ls_inspect_status_show_saved_steps(client_env: DaemonProcess) -> None:
    save("job-a", 10, seeded_state(10, N), staged=False)
    save("job-a", 20, seeded_state(20, N), staged=False)
    save("job-b", 5, seeded_state(5, N), staged=False)

    namespaces = {ns["namespace"]: ns for ns in cli_json("ls")}
    assert set(namespaces) == {"job-a", "job-b"}
    assert namespaces["job-a"]["committed_steps"] == 2
    assert namespaces["job-a"]["latest_committed"] == 20

    steps = cli_json("ls", "job-a")
    assert [(s["step"], s["state"]) for s in steps] == [(10, "committed"), (20, "committed")]
    table = cli("ls", "job-a").stdout
    assert table.splitlines()[0].split() == [
        "STEP",
        "STATE",
        "SIZE",
        "FILES",
        "AGE",
        "TIERS",
        "REPLICAS",
    ]
    assert any(line.split()[:2] == ["20", "committed"] for line in table.splitlines()[1:])
    assert all(s["tiers"] == ["memory"] for s in steps)  # no persistent tier on this daemon

    info = cli_json("inspect", "job-a", "20")
    assert info["state"] == "committed" and info["world_size"] == 1
    assert info["files"] and {f["rank"] for f in info["files"]} == {0}
    # The tensor's bytes are in the tier: the files hold at least the saved 256 KiB.
    assert sum(f["length"] for f in info["files"]) >= N * 4
    assert all(f["size"] >= f["length"] for f in info["files"])
    assert info["bytes"] == sum(f["size"] for f in info["files"])
    text = cli("inspect", "job-a", "20").stdout
    assert "state       committed" in text
    for f in info["files"]:
        assert f["name"] in text

    status = cli_json("status")
    assert status["capacity_bytes"] == 2 << 30  # the fixture's TIERCKPT_CAPACITY=2G
    held = sum(ns["bytes"] for ns in status["namespaces"])
    assert held >= 3 * N * 4
    assert status["used_bytes"] >= held
    assert status["persistent"] is None
    human = cli("status").stdout
    assert "capacity    2.0 GiB" in human and "job-a" in human
    assert "persistent  none" in human


def test_rm_removes_a_step_then_inspect_exits_3(client_env: DaemonProcess) -> None:
    save("job", 1, seeded_state(1, N), staged=False)
    save("job", 2, seeded_state(2, N), staged=False)
    proc = cli("rm", "job", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "removed job step 1"
    assert [s["step"] for s in cli_json("ls", "job")] == [2]

    proc = cli("inspect", "job", "1")
    assert proc.returncode == 3
    assert proc.stdout == ""
    assert proc.stderr.startswith("tierckpt: job/step 1 ")  # what is missing, and where

    assert cli("ls", "no-such-job").returncode == 3
    assert cli("rm", "job", "1").returncode == 3


def test_usage_errors_exit_2(client_env: DaemonProcess) -> None:
    assert cli("inspect", "job", "not-a-step").returncode == 2
    proc = cli("ls", "../etc")
    assert proc.returncode == 2
    assert proc.stderr.startswith("tierckpt: namespace '../etc'")
    assert cli().returncode == 2


def test_socket_flag_wins_and_unreachable_daemon_exits_4(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    missing = tmp_path / "nothing.sock"
    proc = cli("status", node=missing)
    assert proc.returncode == 4
    assert proc.stderr.startswith(f"tierckpt: cannot reach the tierckpt daemon at {missing}")
    # --socket overrides a wrong TIERCKPT_SOCKET.
    proc = cli("--json", "status", "--socket", str(daemon.socket), node=missing)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["shm_dir"] == str(daemon.shm_dir)


# -- the persistent tier: persist, prefetch -----------------------------------------------------


@pytest.fixture
def tiered(tmp_path: Path, make_node: Callable[..., DaemonProcess]) -> DaemonProcess:
    """A daemon with a file:// persistent tier whose policy persists only a namespace's first
    commit (``persist_every=1000``): later steps stay in memory until ``tierckpt persist``."""
    return make_node(client=True, persist_url=f"file://{tmp_path / 'store'}", persist_every=1000)


def _states(ns: str) -> dict[int, tuple[str, list[str]]]:
    return {s["step"]: (s["state"], s["tiers"]) for s in cli_json("ls", ns)}


def _wait_state(ns: str, step: int, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _states(ns).get(step, ("-",))[0] != state:
        assert time.monotonic() < deadline, f"{ns} step {step} never became {state}"
        time.sleep(0.1)


def _cli_tty(
    *args: str, timeout: float = 60.0, on_output: Callable[[str], None] | None = None
) -> tuple[int, str, str]:
    """Run the CLI with its stderr on a pseudo-terminal: (exit code, stdout, terminal output).
    ``on_output`` sees the terminal output so far each time more arrives; a CLI still running
    after ``timeout`` is killed (its exit code then says so)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 0.5)[0]:
                continue
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
            if on_output is not None:
                on_output(b"".join(chunks).decode(errors="replace"))
    finally:
        os.close(master)
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
    assert proc.stdout is not None
    with proc.stdout:
        out = proc.stdout.read().decode()
    return proc.wait(timeout=10), out, b"".join(chunks).decode(errors="replace")


def test_persist_wait_then_prefetch_after_node_loss(tiered: DaemonProcess) -> None:
    save(
        "job", 10, seeded_state(10, N), staged=False
    )  # the namespace's first commit: persisted by the policy
    save("job", 20, seeded_state(20, N), staged=False)  # not persisted by the policy
    _wait_state("job", 10, "durable")
    assert _states("job") == {
        10: ("durable", ["memory", "persistent"]),
        20: ("committed", ["memory"]),
    }
    status = cli_json("status")
    assert status["persistent"]["url"].startswith("file://")
    human = cli("status").stdout
    assert "persistent  file://" in human
    # Its namespace table is this node's memory: no DURABLE column that read "-" beside a
    # healthy persistent tier (ls has the persistent tier's counts).
    header = next(line for line in human.splitlines() if line.startswith("NAMESPACE"))
    assert header.split() == ["NAMESPACE", "STEPS", "COMMITTED", "LATEST", "SIZE"]
    assert "in this node's memory" in human

    proc = cli("persist", "job", "20", "--wait", "--timeout", "30")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "job step 20 is durable"
    assert "job step 20: durable after" in proc.stderr
    assert _states("job")[20] == ("durable", ["memory", "persistent"])

    # The node loses its memory: the steps are only in the persistent tier.
    tiered.kill()
    shutil.rmtree(tiered.shm_dir)
    tiered.start()
    assert _states("job") == {10: ("durable", ["persistent"]), 20: ("durable", ["persistent"])}
    assert "persistent" in cli("ls", "job").stdout.splitlines()[1].split()

    proc = cli("prefetch", "job", "latest")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("job step 20 is in memory (durable")
    assert "prefetch job step 20: starting" in proc.stderr
    # Not a terminal: the bar is drawn once, complete, then a summary line.
    assert "prefetch job step 20 " in proc.stderr and "257.2/257.2 KiB" in proc.stderr
    assert "prefetch job step 20: 257.2 KiB in memory after" in proc.stderr
    steps = {s["step"]: s for s in cli_json("ls", "job")}
    assert steps[20]["in_memory"] and steps[20]["state"] == "durable"
    assert steps[20]["tiers"] == ["memory", "persistent"]
    assert steps[10]["tiers"] == ["persistent"]

    # On a terminal the bar is redrawn in place; --json prints the StepInfo on stdout.
    rc, out, term = _cli_tty("prefetch", "job", "10", "--json")
    assert rc == 0, term
    info = json.loads(out)
    assert (info["step"], info["state"], info["in_memory"]) == (10, "durable", True)
    assert "\x1b[" in term  # redrawn in place (cursor control), ending complete
    assert "prefetch job step 10" in term and "257.2/257.2 KiB" in term
    assert _states("job")[10] == ("durable", ["memory", "persistent"])
    # A step already in memory: no bar, the same answer.
    rc, out, term = _cli_tty("prefetch", "job", "10")
    assert rc == 0, term
    assert "job step 10 is in memory (durable" in out
    assert "257.2/257.2 KiB" not in term and "\x1b[" not in term, term


def test_persist_wait_times_out_with_the_upload_error(
    tiered: DaemonProcess, tmp_path: Path
) -> None:
    save("job", 1, seeded_state(1, N), staged=False)
    _wait_state("job", 1, "durable")
    save("job", 2, seeded_state(2, N), staged=False)
    store = tmp_path / "store"
    shutil.rmtree(store)
    store.write_text("not a directory")  # every upload now fails
    proc = cli("persist", "job", "2", "--wait", "--timeout", "1")
    assert proc.returncode == 1
    assert proc.stdout == ""
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tierckpt: job step 2 is not durable after 1s: job/step 2: upload")
    assert _states("job")[2] == ("committed", ["memory"])


def test_prefetch_latest_skips_a_corrupt_durable_step_as_a_restore_does(
    tiered: DaemonProcess, tmp_path: Path
) -> None:
    """``latest`` is "the step a restore would pick": a durable step whose object in the
    persistent tier is corrupt is skipped for the next older one, with a warning (prefetch
    failed on it before, where a restore and ``export`` went on to the older step)."""
    for step in (10, 20):
        save("job", step, seeded_state(step, N), staged=False)
        cli("persist", "job", str(step), "--wait", "--timeout", "30")
    data = max((tmp_path / "store" / "job" / "step_000000000020").iterdir(), key=os.path.getsize)
    flip_byte(data, 100)
    for step in ("10", "20"):
        assert cli("rm", "job", step).returncode == 0
    proc = cli("prefetch", "job", "latest")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("job step 10 is in memory (durable")
    assert "skipping step 20 for an older one" in proc.stderr and "corrupt" in proc.stderr
    assert cli("prefetch", "job", "20").returncode != 0  # an explicit step: its error


def test_persist_and_prefetch_errors(tiered: DaemonProcess) -> None:
    assert cli("persist", "job", "1").returncode == 3  # no such namespace
    assert cli("prefetch", "job", "latest").returncode == 3
    assert cli("prefetch", "job", "7").returncode == 3
    assert cli("prefetch", "job", "soon").returncode == 2


def test_persist_without_a_persistent_tier_exits_1(client_env: DaemonProcess) -> None:
    save("job", 1, seeded_state(1, N), staged=False)
    proc = cli("persist", "job", "1", "--wait")
    assert proc.returncode == 1
    assert "no persistent tier is configured" in proc.stderr


def test_persist_wait_shows_bytes_rate_and_eta(
    s3_env: SeaweedS3, make_node: Callable[..., DaemonProcess], request: pytest.FixtureRequest
) -> None:
    # The persistent tier is S3 behind a proxy that holds step 2's uploads (as a server that
    # stopped answering would) until the CLI has drawn its bar: the bar is seen however long the
    # CLI takes to start. Not a rate cap: on a loaded machine the upload could end before the
    # CLI's first look, and it would find the step durable and draw nothing.
    with S3FaultProxy(s3_env.endpoint) as proxy:
        proxy.add("stall", key=r"/step_000000000002/")  # every request for its objects
        d = make_node(
            client=True,
            persist_url=f"s3://{s3_env.bucket}/{request.node.name}",
            s3_endpoint=proxy.endpoint,
            s3_timeout=600,  # the held upload must not time out while the CLI starts
        )
        save("job", 1, seeded_state(1, N), staged=False)  # both uploaded by the default policy
        save("job", 2, seeded_state(2, N), staged=False)
        total = sum(f["length"] for f in cli_json("inspect", "job", "2")["files"])
        with DaemonClient.from_socket(d.socket) as client:
            deadline = time.monotonic() + 120
            while True:
                p = client.status().persistent
                assert p is not None
                mine = [u for u in p.uploads if u.step == 2]
                if mine and proxy.injected():
                    break
                assert time.monotonic() < deadline, f"step 2's upload never started: {p}"
                time.sleep(0.05)
        u = mine[0]
        assert (u.namespace, u.step, u.total_bytes) == ("job", 2, total)
        assert 0 <= u.done_bytes < total

        def release_once_drawn(term: str) -> None:
            if "job step 2: uploading" in term:
                proxy.clear()
                proxy.release()  # the held requests are reset; their retries go through

        rc, out, term = _cli_tty(
            "persist", "job", "2", "--wait", timeout=120, on_output=release_once_drawn
        )
    assert rc == 0, term
    assert out.strip() == "job step 2 is durable"
    assert "job step 2: uploading" in term  # the bar while bytes are still going out
    assert "/257.2 KiB" in term and "0:00:0" in term  # bytes done/total, and the ETA
    assert "job step 2: durable after" in term
    assert cli_json("status")["persistent"]["uploads"] == []
