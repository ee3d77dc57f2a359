"""What an operator meets when a setting is wrong (issue 33): the daemon, started as a user starts
it (``python -m tierckpt_daemon`` with ``TIERCKPT_*`` in its environment), refuses with exit 2 and
one line naming the setting, or warns naming what it found; never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt_client import ClientConfig, DaemonClient

from helpers import DaemonProcess, new_shm_dir
from kit import blank_state, load, save, seeded_state

N = 4096


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCKPT_")}
    env.update({f"TIERCKPT_{k.upper()}": v for k, v in settings.items()})
    env.setdefault("TIERCKPT_PORT", "0")
    return env


def _run(env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The daemon run to its exit (each case here refuses to start)."""
    return subprocess.run(
        [sys.executable, "-m", "tierckpt_daemon"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _refused(proc: subprocess.CompletedProcess[str], setting: str, message: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "tierckpt-daemon:" in ln]
    assert len(lines) == 1, proc.stderr
    assert f"invalid setting {setting}" in lines[0] and message in lines[0], lines[0]


def test_s3_endpoint_without_a_scheme_is_refused_at_start(tmp_path: Path) -> None:
    proc = _run(
        _env(
            shm_dir=str(tmp_path / "tier"),
            persist_url="s3://bucket/prefix",
            s3_endpoint="127.0.0.1:9000",
        )
    )
    _refused(proc, "TIERCKPT_S3_ENDPOINT", "'127.0.0.1:9000': it needs the scheme")
    assert "http://" in proc.stderr


def _too_long_socket(tmp_path: Path) -> dict[str, str]:
    return _env(shm_dir=str(tmp_path / "tier"), socket=str(tmp_path / ("s" * 120)))


@pytest.mark.parametrize(
    ("case", "setting", "message"),
    [
        ("log_level", "TIERCKPT_LOG_LEVEL", "'LOUD' is not one of DEBUG, INFO"),
        ("a_file", "TIERCKPT_SHM_DIR", "exists and is not a directory"),
        ("a_link", "TIERCKPT_SHM_DIR", "is a symbolic link"),
        ("unwritable", "TIERCKPT_SHM_DIR", "cannot create /sys/tierckpt-test"),
        ("long_socket", "TIERCKPT_SOCKET", "a Unix socket's path holds at most 107"),
        ("bare_capacity", "TIERCKPT_CAPACITY", "'40' is 40 bytes, below the 64 MiB"),
        ("another_users", "TIERCKPT_SHM_DIR", "belongs to uid 2002, not to the daemon (uid"),
        ("shared", "TIERCKPT_SHM_DIR", "is a shared directory (mode 1777"),
    ],
)
def test_bad_tier_settings_exit_2_naming_the_setting(
    tmp_path: Path, case: str, setting: str, message: str
) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    tier = str(tmp_path / "tier")
    if case == "another_users":
        if os.geteuid() != 0:
            pytest.skip("gives a directory to another user (root)")
        (tmp_path / "theirs").mkdir(mode=0o755)
        os.chown(tmp_path / "theirs", 2002, 0)
    (tmp_path / "shared").mkdir()
    os.chmod(tmp_path / "shared", 0o1777)  # as /dev/shm is: never to be made the daemon's
    env = {
        "log_level": _env(shm_dir=tier, log_level="LOUD"),
        "a_file": _env(shm_dir=str(tmp_path / "file")),
        "a_link": _env(shm_dir=str(tmp_path / "link")),
        # Root may write anywhere else: sysfs refuses a new directory even to root.
        "unwritable": _env(shm_dir="/sys/tierckpt-test"),
        "long_socket": _too_long_socket(tmp_path),
        "bare_capacity": _env(shm_dir=tier, capacity="40"),
        "another_users": _env(shm_dir=str(tmp_path / "theirs")),
        "shared": _env(shm_dir=str(tmp_path / "shared")),
    }[case]
    proc = _run(env)
    _refused(proc, setting, message)


def _serve(env: dict[str, str], socket: Path, log: Path, cwd: Path | None = None) -> Any:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierckpt_daemon"], env=env, cwd=cwd, stdout=out, stderr=out
        )
    deadline = time.monotonic() + 60
    while not DaemonClient(ClientConfig(socket=socket, connect_timeout_s=1.0)).ping():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc


def _remove(d: DaemonProcess) -> None:
    d.lose_node()
    d.log_path.unlink(missing_ok=True)


def _stop(proc: Any) -> None:
    proc.terminate()
    proc.wait(timeout=60)


def test_relative_tier_dir_serves_trainers_in_other_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TIERCKPT_SHM_DIR=tier in /x: the daemon works in /x/tier, and a trainer elsewhere (with
    the socket's absolute path) saves and loads."""
    shm = new_shm_dir()
    shm.mkdir()
    try:
        proc = _serve(_env(shm_dir="tier"), shm / "tier" / "daemon.sock", tmp_path / "d.log", shm)
        try:
            monkeypatch.setenv("TIERCKPT_SOCKET", str(shm / "tier" / "daemon.sock"))
            monkeypatch.chdir(tmp_path)
            save("rel", 1, seeded_state(1, N), staged=False)
            step, out = load("rel", blank_state(N))
            assert step == 1 and torch.equal(out["w"], seeded_state(1, N)["w"])
            with DaemonClient() as c:
                assert c.status().shm_dir == str(shm / "tier")
        finally:
            _stop(proc)
    finally:
        subprocess.run(["rm", "-rf", str(shm)], check=True)


def test_links_among_the_tier_dirs_parents_are_resolved(tmp_path: Path) -> None:
    """/var/run/tierckpt where /var/run is a link to /run: the daemon serves /run/tierckpt."""
    shm = new_shm_dir()
    (shm / "run").mkdir(parents=True)
    (tmp_path / "var-run").symlink_to(shm / "run")
    try:
        tier = tmp_path / "var-run" / "tierckpt"
        proc = _serve(_env(shm_dir=str(tier)), tier / "daemon.sock", tmp_path / "d.log")
        try:
            with DaemonClient(ClientConfig(socket=tier / "daemon.sock")) as c:
                assert c.status().shm_dir == str(shm / "run" / "tierckpt")
        finally:
            _stop(proc)
    finally:
        subprocess.run(["rm", "-rf", str(shm)], check=True)


def test_misspelt_setting_is_named_with_the_closest_one(tmp_path: Path) -> None:
    # Warned: the daemon starts, memory only, and says why.
    d = DaemonProcess(
        new_shm_dir(),
        extra_env={"TIERCKPT_PERIST_URL": f"file://{tmp_path}/store"},
    )
    try:
        d.start()
        d.stop()
        assert (
            "TIERCKPT_PERIST_URL is not a tierckpt setting (did you mean TIERCKPT_PERSIST_URL?)"
            in d.log()
        )
        # Client settings in the daemon's environment are settings, not misspellings.
        assert "TIERCKPT_VERIFY_READS is not" not in d.log()
    finally:
        _remove(d)
    # Strict: refused before anything is created.
    proc = _run(
        _env(
            shm_dir=str(tmp_path / "tier"),
            strict_settings="1",
            perist_url=f"file://{tmp_path}/store",
            verify_reads="1",
        )
    )
    assert proc.returncode == 2, proc.stderr
    assert "did you mean TIERCKPT_PERSIST_URL?); not starting" in proc.stderr
    assert "ignored" not in proc.stderr
    assert "TIERCKPT_VERIFY_READS" not in proc.stderr
    assert not (tmp_path / "tier").exists()


def test_capacity_beyond_the_tmpfs_and_a_tier_off_tmpfs_are_warned(tmp_path: Path) -> None:
    d = DaemonProcess(new_shm_dir(), capacity="1000T")
    try:
        d.start()
        d.stop()
        log = d.log()
        assert "TIERCKPT_CAPACITY 1000T is 1024000.00 GiB" in log
        assert "of memory this daemon may use" in log and "tmpfs at /dev/shm" in log
    finally:
        _remove(d)
    disk = Path("/var/tmp") / f"tierckpt-test-{os.getpid()}"
    d = DaemonProcess(disk, capacity="64M")
    try:
        d.start()
        d.stop()
        assert f"the tier directory {disk} is on a" in d.log() and "not tmpfs" in d.log()
    finally:
        _remove(d)
