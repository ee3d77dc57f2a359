"""The ``tierckpt`` CLI against a real daemon holding steps that a real ``dcp.save`` created."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tierckpt_client.dcp import TieredStorageWriter

from helpers import DaemonProcess

N = 64 * 1024  # 256 KiB of float32 per step


def _save(ns: str, step: int) -> None:
    state = {"w": torch.full((N,), float(step)), "meta": {"step": step}}
    dcp.save(state, storage_writer=TieredStorageWriter(ns, step), no_dist=True)


def _cli(*args: str, socket: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if socket is not None:
        env["TIERCKPT_SOCKET"] = str(socket)
    return subprocess.run(
        [sys.executable, "-m", "tierckpt_client.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _json(*args: str) -> Any:
    proc = _cli(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_ls_inspect_status_show_saved_steps(client_env: DaemonProcess) -> None:
    _save("job-a", 10)
    _save("job-a", 20)
    _save("job-b", 5)

    namespaces = {ns["namespace"]: ns for ns in _json("ls")}
    assert set(namespaces) == {"job-a", "job-b"}
    assert namespaces["job-a"]["committed_steps"] == 2
    assert namespaces["job-a"]["latest_committed"] == 20

    steps = _json("ls", "job-a")
    assert [(s["step"], s["state"]) for s in steps] == [(10, "committed"), (20, "committed")]
    table = _cli("ls", "job-a").stdout
    assert table.splitlines()[0].split() == ["STEP", "STATE", "SIZE", "FILES", "AGE"]
    assert any(line.split()[:2] == ["20", "committed"] for line in table.splitlines()[1:])

    info = _json("inspect", "job-a", "20")
    assert info["state"] == "committed" and info["world_size"] == 1
    assert info["files"] and {f["rank"] for f in info["files"]} == {0}
    # The tensor's bytes are in the tier: the files hold at least the saved 256 KiB.
    assert sum(f["length"] for f in info["files"]) >= N * 4
    assert all(f["size"] >= f["length"] for f in info["files"])
    assert info["bytes"] == sum(f["size"] for f in info["files"])
    text = _cli("inspect", "job-a", "20").stdout
    assert "state       committed" in text
    for f in info["files"]:
        assert f["name"] in text

    status = _json("status")
    assert status["capacity_bytes"] == 2 << 30  # the fixture's TIERCKPT_CAPACITY=2G
    held = sum(ns["bytes"] for ns in status["namespaces"])
    assert held >= 3 * N * 4
    assert status["used_bytes"] >= held
    human = _cli("status").stdout
    assert "capacity    2.0 GiB" in human and "job-a" in human


def test_rm_removes_a_step_then_inspect_exits_3(client_env: DaemonProcess) -> None:
    _save("job", 1)
    _save("job", 2)
    proc = _cli("rm", "job", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "removed job step 1"
    assert [s["step"] for s in _json("ls", "job")] == [2]

    proc = _cli("inspect", "job", "1")
    assert proc.returncode == 3
    assert proc.stdout == ""
    assert proc.stderr.startswith("tierckpt: job/step 1 ")  # what is missing, and where

    assert _cli("ls", "no-such-job").returncode == 3
    assert _cli("rm", "job", "1").returncode == 3


def test_usage_errors_exit_2(client_env: DaemonProcess) -> None:
    assert _cli("inspect", "job", "not-a-step").returncode == 2
    proc = _cli("ls", "../etc")
    assert proc.returncode == 2
    assert proc.stderr.startswith("tierckpt: namespace '../etc'")
    assert _cli().returncode == 2


def test_socket_flag_wins_and_unreachable_daemon_exits_4(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    missing = tmp_path / "nothing.sock"
    proc = _cli("status", socket=missing)
    assert proc.returncode == 4
    assert proc.stderr.startswith(f"tierckpt: cannot reach the tierckpt daemon at {missing}")
    # --socket overrides a wrong TIERCKPT_SOCKET.
    proc = _cli("--json", "status", "--socket", str(daemon.socket), socket=missing)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["shm_dir"] == str(daemon.shm_dir)
