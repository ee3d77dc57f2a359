"""The ``tierckpt`` CLI for operators (issue 33): a save a trainer left when it was killed
mid-save is seen and freed; the persistent tier is read without a daemon. Real daemons, a real
trainer process killed with SIGKILL, file:// and SeaweedFS stores, the CLI as a subprocess."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from seaweed import SeaweedS3

from tierckpt_client import ClientConfig, DaemonClient

from helpers import DaemonProcess
from kit import cli, cli_json, save, seeded_state

# A trainer whose save has sealed its files and stops before the commit (finish): where a
# trainer killed mid-save leaves its attempt.
STUCK_TRAINER = """
import sys, time
import torch
import torch.distributed.checkpoint as dcp
from tierckpt_client.dcp import TieredStorageWriter

class StuckBeforeCommit(TieredStorageWriter):
    def finish(self, metadata, results):
        print("sealed", flush=True)
        time.sleep(600)

writer = StuckBeforeCommit(sys.argv[1], int(sys.argv[2]))
dcp.save({"w": torch.ones(1 << 20)}, storage_writer=writer, no_dist=True)
"""


def _start_stuck_trainer(ns: str, step: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_TRAINER, ns, str(step)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 90)  # bound: a torch import on 2 cores
    if not ready or proc.stdout.readline().strip() != "sealed":
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        pytest.fail("the trainer never sealed its save")
    return proc


@pytest.mark.slow
def test_a_save_left_by_a_killed_trainer_is_shown_and_freed(client_env: DaemonProcess) -> None:
    ns, step = "killed", 7
    trainer = _start_stuck_trainer(ns, step)
    try:
        # While the trainer runs, its save is not abandoned: the daemon refuses to free it.
        busy = cli("rm", ns, str(step), "--abandoned")
        assert busy.returncode == 1, busy
        assert "still runs" in busy.stderr and str(trainer.pid) in busy.stderr
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(10)
        assert trainer.stdout is not None
        trainer.stdout.close()

    listing = cli("ls", ns)
    assert listing.returncode == 0, listing.stderr
    row = listing.stdout.splitlines()[1].split()
    assert row[:2] == [str(step), "writing"]
    assert "its writer is gone; the daemon reclaims it in 1" in listing.stdout  # in 15m
    assert f"tierckpt rm {ns} {step} --abandoned" in listing.stdout

    info = cli_json("inspect", ns, str(step))
    assert info["state"] == "writing"
    (attempt,) = info["attempts"]
    assert attempt["writer_alive"] is False and attempt["writers"] == [trainer.pid]
    assert attempt["owner"] == f"uid:{os.getuid()}"
    assert attempt["bytes"] >= 4 << 20 and attempt["files"]
    assert 800 < attempt["reclaim_in_s"] <= 900  # TIERCKPT_LEASE_TTL_S
    text = cli("inspect", ns, str(step)).stdout
    assert attempt["attempt"] in text and "gone (pid" in text

    # rm without --abandoned says what to do; with it, the memory is free now.
    plain = cli("rm", ns, str(step))
    assert plain.returncode == 3 and "--abandoned" in plain.stderr, plain
    freed = cli("rm", ns, str(step), "--abandoned")
    assert freed.returncode == 0, freed.stderr
    assert attempt["attempt"] in freed.stdout
    status = DaemonClient.from_socket(client_env.socket).status()
    assert status.leased_bytes == 0
    assert status.pool_bytes >= attempt["bytes"]  # back in the pool, for the next lease
    assert cli("inspect", ns, str(step)).returncode == 3


# -- the persistent tier without a daemon (issue 33 item 11) -----------------------------------
N = 64 * 1024  # 256 KiB of float32


def _store_only(tmp_path: Path, url: str, env: dict[str, str]) -> dict[str, str]:
    """Save ``job`` step 5 straight into the store at ``url`` (no daemon: the writer's
    degraded path), and return the CLI's environment for that store with no daemon running."""
    config = ClientConfig.from_env(
        env={**os.environ, **env}, socket=tmp_path / "no-daemon.sock", persist_url=url
    )
    save("job", 5, seeded_state(5, N), config=config, staged=False)
    return {**env, "TIERCKPT_SOCKET": str(tmp_path / "no-daemon.sock"), "TIERCKPT_PERSIST_URL": url}


def _check_daemonless(env: dict[str, str], tmp_path: Path, *, export: bool) -> None:
    listing = cli("--json", "ls", env=env)
    assert listing.returncode == 0, listing.stderr
    assert "cannot be reached: reading only the persistent tier" in listing.stderr
    assert [
        (x["namespace"], x["durable_steps"], x["tiers"]) for x in json.loads(listing.stdout)
    ] == [("job", 1, ["persistent"])]
    assert [(x["step"], x["tiers"]) for x in cli_json("ls", "job", env=env)] == [
        (5, ["persistent"])
    ]
    info = cli_json("inspect", "job", "5", env=env)
    assert info["state"] == "durable" and info["files"]
    verified = cli_json("verify", "job", "5", env=env)
    assert verified["ok"] is True and verified["tiers"] == ["persistent"]
    if not export:
        return
    # A step that is not there: exit 3, and the export leaves no directory behind.
    failed = cli("export", "job", "6", str(tmp_path / "out-6"), env=env)
    assert failed.returncode == 3, failed.stderr
    assert not (tmp_path / "out-6").exists()
    exported = cli("export", "job", "5", str(tmp_path / "out-5"), env=env)
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out-5" / ".metadata").is_file()


@pytest.mark.slow
def test_ls_inspect_verify_export_read_a_file_store_without_a_daemon(tmp_path: Path) -> None:
    env = _store_only(tmp_path, f"file://{tmp_path / 'store'}", {})
    _check_daemonless(env, tmp_path, export=True)


@pytest.mark.slow
def test_ls_inspect_verify_export_read_an_s3_store_without_a_daemon(
    tmp_path: Path, s3_env: SeaweedS3
) -> None:
    url = f"s3://{s3_env.bucket}/nodaemon-{uuid.uuid4().hex[:8]}"
    env = _store_only(tmp_path, url, s3_env.env())
    _check_daemonless(env, tmp_path, export=False)


@pytest.mark.slow
def test_rm_points_at_persistent_and_ls_ns_fails_on_an_unreadable_store(
    tmp_path: Path, seaweed: SeaweedS3, client_env: DaemonProcess
) -> None:
    url = f"file://{tmp_path / 'store'}"
    env = _store_only(tmp_path, url, {})
    env["TIERCKPT_SOCKET"] = str(client_env.socket)  # a daemon without that store
    rm = cli("rm", "job", "5", env=env)
    assert rm.returncode == 3
    assert "tierckpt rm job 5 --persistent --yes deletes it there" in rm.stderr
    # A store that cannot be listed: `ls` and `ls NS` both show memory, name the error, exit 1.
    save("mem-only", 1, seeded_state(1, N), staged=False)
    broken = {**seaweed.env(), "TIERCKPT_PERSIST_URL": "s3://no-such-bucket-cli/x"}
    for args in (("ls",), ("ls", "mem-only")):
        proc = cli(*args, env=broken)
        assert proc.returncode == 1, (args, proc)
        assert proc.stdout.splitlines()[1].split()[0] in ("mem-only", "1"), args
        assert proc.stderr.startswith("tierckpt: cannot list the persistent tier s3://no-such-")


# -- kubectl's habits (issue 33 item 14) --------------------------------------------------------
@pytest.mark.slow
def test_output_formats_no_headers_quiet_and_help(client_env: DaemonProcess) -> None:
    for step in (10, 20):
        save("habits", step, seeded_state(step, N), staged=False)
    assert cli("ls", "-o", "name").stdout.split() == ["habits"]
    assert cli("ls", "habits", "-o", "name").stdout.split() == ["habits/10", "habits/20"]
    rows = cli("ls", "habits", "--no-headers").stdout.splitlines()
    assert [row.split()[:2] for row in rows] == [["10", "committed"], ["20", "committed"]]
    wide = cli("ls", "habits", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-4:] == ["WORLD", "OWNER", "CREATED", "ATTEMPT"]
    world, owner, created, attempt = wide[1].split()[-4:]
    assert (world, owner, attempt) == ("1", f"uid:{os.getuid()}", "-") and created.endswith("s")
    assert json.loads(cli("-o", "json", "ls", "habits").stdout) == cli_json("ls", "habits")
    assert cli("status", "-o", "name").returncode == 2  # a status has no names
    quiet = cli("-q", "rm", "habits", "10")
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    helped = cli("help", "rm")
    assert helped.returncode == 0 and helped.stdout == cli("rm", "--help").stdout
    assert cli("help", "no-such-command").returncode == 2
