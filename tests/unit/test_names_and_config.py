from __future__ import annotations

import pickle

import pytest

from tierckpt_client import ClientConfig
from tierckpt_client.dcp.ids import parse_checkpoint_id
from tierckpt_core.errors import (
    ERROR_CODES,
    CapacityExceededError,
    InvalidNameError,
    StepNotFoundError,
    error_from_code,
)
from tierckpt_core.protocol import validate_file_name, validate_namespace, validate_step
from tierckpt_daemon.config import DaemonSettings, parse_capacity, parse_size


@pytest.mark.parametrize("name", ["job", "job-1.run_2", "A" * 128, "0"])
def test_valid_namespaces(name: str) -> None:
    assert validate_namespace(name) == name


@pytest.mark.parametrize(
    "name", ["", "a/b", "..", "a..b", ".hidden", "-x", "a b", "A" * 129, "ns%2F", None, 3]
)
def test_invalid_namespaces_name_the_value(name: object) -> None:
    with pytest.raises(InvalidNameError, match="namespace"):
        validate_namespace(name)


def test_steps_and_files() -> None:
    assert validate_step(0) == 0
    for bad in (-1, 10**12, True, "3", 1.5):
        with pytest.raises(InvalidNameError, match="step"):
            validate_step(bad)
    with pytest.raises(InvalidNameError, match="file name"):
        validate_file_name("../x")


def test_checkpoint_ids() -> None:
    assert parse_checkpoint_id("tierckpt://job/12") == ("job", 12)
    assert parse_checkpoint_id("tierckpt://job") == ("job", None)
    for bad in ("file:///x", "tierckpt://job/abc", "tierckpt://../1"):
        with pytest.raises(InvalidNameError):
            parse_checkpoint_id(bad)


def test_errors_pickle_and_map_back_from_codes() -> None:
    for cls in ERROR_CODES.values():
        e = pickle.loads(pickle.dumps(cls("what happened where")))
        assert type(e) is cls and str(e) == "what happened where"
    assert isinstance(error_from_code("capacity_exceeded", "x"), CapacityExceededError)
    assert isinstance(error_from_code("step_not_found", "x"), StepNotFoundError)
    assert type(error_from_code("from-a-newer-daemon", "x")).__name__ == "TierCkptError"


def test_sizes_and_capacity() -> None:
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("100") == 100
    assert parse_capacity("25%", node_bytes=8 << 30) == 2 << 30
    for bad in ("lots", "-1G", "12X"):
        with pytest.raises(ValueError, match="cannot parse"):
            parse_size(bad)
    with pytest.raises(ValueError, match=r"percent must be in \(0, 100\]"):
        parse_capacity("150%")


def test_daemon_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_SHM_DIR", "/dev/shm/x")
    monkeypatch.setenv("TIERCKPT_CAPACITY", "3G")
    monkeypatch.setenv("TIERCKPT_KEEP_LAST", "5")
    s = DaemonSettings()
    assert str(s.socket_path) == "/dev/shm/x/daemon.sock"
    assert s.capacity_bytes == 3 << 30 and s.keep_last == 5
    monkeypatch.setenv("TIERCKPT_CAPACITY", "half")
    with pytest.raises(ValueError, match="cannot parse size 'half'"):
        DaemonSettings()


def test_client_config_env_and_overrides() -> None:
    cfg = ClientConfig.from_env({"TIERCKPT_SHM_DIR": "/dev/shm/y", "TIERCKPT_TIMEOUT": "7"})
    assert str(cfg.socket) == "/dev/shm/y/daemon.sock" and cfg.timeout_s == 7.0
    cfg = ClientConfig.from_env({"TIERCKPT_SOCKET": "/run/a.sock"}, socket="/run/b.sock")
    assert str(cfg.socket) == "/run/b.sock"
    with pytest.raises(ValueError, match="TIERCKPT_TIMEOUT='soon' is not a number"):
        ClientConfig.from_env({"TIERCKPT_TIMEOUT": "soon"})


def test_restores_read_an_s3_tier_directly_unless_told_otherwise() -> None:
    def direct(**env: str) -> bool:
        return ClientConfig.from_env(env).reads_direct()

    assert not direct()  # no persistent tier known to the trainer: the daemon hydrates
    assert direct(TIERCKPT_PERSIST_URL="s3://b/p")
    assert not direct(TIERCKPT_PERSIST_URL="file:///mnt/x")
    assert direct(TIERCKPT_PERSIST_URL="file:///mnt/x", TIERCKPT_RESTORE_DIRECT="on")
    assert not direct(TIERCKPT_PERSIST_URL="s3://b/p", TIERCKPT_RESTORE_DIRECT="0")
    with pytest.raises(
        ValueError, match="TIERCKPT_RESTORE_DIRECT='sometimes' is not auto, on or off"
    ):
        ClientConfig.from_env({"TIERCKPT_RESTORE_DIRECT": "sometimes"})


def test_daemon_rejects_a_bad_persistent_tier_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", "ftp://host/x")
    with pytest.raises(ValueError, match="unsupported store URL 'ftp://host/x'"):
        DaemonSettings()
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", "file:///mnt/fsx/ckpt")
    assert DaemonSettings().persist_url == "file:///mnt/fsx/ckpt"


def test_transient_failures_share_one_class_to_catch() -> None:
    from tierckpt_client import UnavailableError
    from tierckpt_core.errors import (
        DaemonUnavailableError,
        PeerUnavailableError,
        PersistentTierError,
        PersistentTierUnavailableError,
    )

    for code in ("daemon_unavailable", "peer_unavailable", "persistent_tier_unavailable"):
        assert isinstance(error_from_code(code, "x"), UnavailableError)
    # A throttled or timed-out S3 call is still a persistent-tier failure to those who ask.
    assert issubclass(PersistentTierUnavailableError, PersistentTierError)
    assert not issubclass(PersistentTierError, UnavailableError)
    assert {DaemonUnavailableError, PeerUnavailableError} <= set(UnavailableError.__subclasses__())
