"""The start-up checks' tables and messages (the daemon-level behaviour is in
tests/integration/test_start_checks.py)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from tierckpt_client import config
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp.sources._progress import Progress
from tierckpt_core.setting_names import SETTINGS
from tierckpt_daemon.config import DaemonSettings
from tierckpt_daemon.startup import capacity_findings, known_settings, unknown_settings

ROOT = Path(__file__).parents[2]

# Sources of every TIERCKPT_* setting read outside DaemonSettings.
READERS = [
    "client/tierckpt_client/config.py",
    "core/tierckpt_core/objectstore/settings.py",
    "webhook/tierckpt_webhook/server.py",
    "deploy/slurm/tierckpt-srun-wrapper.sh",
]


def test_every_setting_read_anywhere_is_known() -> None:
    read = {
        name
        for path in READERS
        for name in re.findall(r"\bTIERCKPT_[A-Z0-9_]*[A-Z0-9]\b", (ROOT / path).read_text())
    }
    assert read - known_settings() == set()


def test_the_list_every_part_warns_with_is_every_setting() -> None:
    """tierckpt_core.setting_names.SETTINGS, which a trainer's client warns against, is exactly
    the daemon's settings and the other parts' (a new setting added to one but not the other
    fails here, not as a false warning in a user's job)."""
    assert known_settings() == SETTINGS


def test_a_trainer_is_warned_once_of_a_misspelt_setting(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in [n for n in os.environ if n.startswith("TIERCKPT_")]:  # (the suite's own knobs)
        monkeypatch.delenv(name)
    monkeypatch.setattr(config, "_warned", set())  # (once per process: as if none yet)
    monkeypatch.setenv("TIERCKPT_ASYNC_STAGNG", "0")  # asynchronous staging stays on: said
    monkeypatch.setenv("TIERCKPT_PERSIST_EVERY", "10")  # the daemon's, in a shared env: fine
    caplog.set_level(logging.WARNING, "tierckpt_client.config")
    assert ClientConfig.from_env().async_staging is True
    ClientConfig.from_env()
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        "TIERCKPT_ASYNC_STAGNG is not a tierckpt setting (did you mean TIERCKPT_ASYNC_STAGING?); "
        "it is ignored"
    ]


def test_unknown_settings_name_the_closest() -> None:
    env = {
        "TIERCKPT_PERIST_URL": "x",
        "TIERCKPT_SOCKET": "/s",  # a trainer's
        "TIERCKPT_CAPACITY_BYTES": "1",  # derived, never read
        "TIERCKPT_ZZZ": "1",
        "OTHER": "1",
    }
    assert unknown_settings(env) == [
        "TIERCKPT_CAPACITY_BYTES is not a tierckpt setting (did you mean TIERCKPT_CAPACITY?)",
        "TIERCKPT_PERIST_URL is not a tierckpt setting (did you mean TIERCKPT_PERSIST_URL?)",
        "TIERCKPT_ZZZ is not a tierckpt setting (no setting has a similar name)",
    ]


def test_capacity_findings_name_both_numbers(tmp_path: Path) -> None:
    s = DaemonSettings(shm_dir=tmp_path / "t", capacity="2G")
    found = capacity_findings(s, node_bytes=1 << 30, fs=("/data", "ext4"))
    assert "is on a ext4 file system (/data), not tmpfs" in found[0]
    assert "2G is 2.00 GiB (2147483648 bytes), more than the 1.00 GiB" in found[1]
    assert capacity_findings(s, node_bytes=4 << 30, fs=("/dev/shm", "tmpfs"))[:1] != found[:1]
    small = DaemonSettings(shm_dir=tmp_path / "t", capacity="1M")
    assert "below 64 MiB" in capacity_findings(small, node_bytes=4 << 30, fs=("/", "tmpfs"))[0]


def test_progress_lines_only_for_long_reads(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "tierckpt_client.dcp.reader")
    quick = Progress("job/step 1: reading in the persistent tier", 2 << 20)
    quick.add(2 << 20)
    quick.finish()
    assert not caplog.records
    slow = Progress("job/step 2: reading in the persistent tier", 4 << 20, interval_s=0)
    slow.add(1 << 20)
    slow.finish()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "job/step 2: reading in the persistent tier: 1 of 4 MiB read",
        "job/step 2: reading in the persistent tier: all 1 MiB read in 0s",
    ]


def test_an_s3_client_that_cannot_be_made_is_a_persistent_tier_error() -> None:
    """Not a ValueError from deep in boto3: callers that keep the memory tier serving when the
    persistent tier fails ("latest", the uploader's health) catch PersistentTierError."""
    from tierckpt_core.errors import PersistentTierError
    from tierckpt_core.objectstore.s3_clients import new_boto_client
    from tierckpt_core.objectstore.settings import StoreSettings

    with pytest.raises(PersistentTierError, match="cannot make an S3 client for endpoint"):
        new_boto_client(
            region="us-east-1",
            endpoint="127.0.0.1:9000",
            force_path_style=True,
            max_attempts=1,
            timeout_s=1,
        )
    with pytest.raises(PersistentTierError, match="invalid TIERCKPT_S3_ENDPOINT"):
        StoreSettings.from_env({"TIERCKPT_S3_ENDPOINT": "127.0.0.1:9000"})
    with pytest.raises(PersistentTierError, match="invalid TIERCKPT_S3_REGION 'us east'"):
        StoreSettings.from_env({"TIERCKPT_S3_REGION": "us east"})


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"TIERCKPT_S3_ENDPOINT": "127.0.0.1:9000"},
            "invalid setting TIERCKPT_S3_ENDPOINT: '127.0.0.1:9000': it needs the scheme",
        ),
        ({"TIERCKPT_S3_TIMEOUT": "0"}, "invalid setting TIERCKPT_S3_TIMEOUT: '0': seconds > 0"),
        ({"TIERCKPT_S3_TIMEOUT": "inf"}, "invalid setting TIERCKPT_S3_TIMEOUT: 'inf': seconds"),
        ({"TIERCKPT_S3_TIMEOUT": "nan"}, "invalid setting TIERCKPT_S3_TIMEOUT: 'nan': seconds"),
        (
            {"TIERCKPT_S3_MAX_ATTEMPTS": "two"},
            "invalid setting TIERCKPT_S3_MAX_ATTEMPTS: 'two': a whole number >= 1",
        ),
        ({"AWS_REGION": "us east"}, "invalid setting AWS_REGION: 'us east': an S3 region name"),
    ],
)
def test_an_s3_setting_is_refused_under_its_own_name(
    env: dict[str, str],
    line: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The persist URL's check reads the S3 settings: a refused one was reported as
    TIERCKPT_PERSIST_URL, and the timeout's and the attempts' together."""
    from tierckpt_daemon.__main__ import main

    for name in [n for n in os.environ if n.startswith(("TIERCKPT_", "AWS_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TIERCKPT_SHM_DIR", str(tmp_path / "tier"))
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", "s3://bucket/prefix")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tierckpt-daemon: {line}"), err
