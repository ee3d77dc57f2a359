from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import DaemonProcess, new_shm_dir, other_workers_share, ring, started

PEER_TOKEN = "test-peer-token-not-a-secret-0123456789"


@pytest.fixture(autouse=True)
def _beside_other_workers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test but the network scenarios runs beside the other workers' tests (addopts'
    ``-n 2``); those hold the other workers off for their whole file (tests/network/conftest.py)."""
    if request.node.get_closest_marker("network") is not None:
        yield
        return
    with other_workers_share():
        yield


@pytest.fixture
def daemon(request: pytest.FixtureRequest) -> Iterator[DaemonProcess]:
    """A real daemon on a real Unix socket; settings from ``@pytest.mark.daemon_settings(...)``."""
    marker = request.node.get_closest_marker("daemon_settings")
    settings = dict(marker.kwargs) if marker else {}
    with started(**settings) as d:
        yield d


@pytest.fixture
def client_env(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> DaemonProcess:
    """Point this process's clients (ClientConfig.from_env) at ``daemon``."""
    monkeypatch.setenv("TIERCKPT_SOCKET", str(daemon.socket))
    return daemon


@pytest.fixture
def make_node(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., DaemonProcess]]:
    """``make_node(**settings)``: a daemon with these ``TIERCKPT_*`` settings on a fresh tier
    directory, started (``start=False``: not yet); ``client=True`` also points this process's
    clients (``TIERCKPT_SOCKET``) at it. Every daemon made is cleaned up after the test."""
    made: list[DaemonProcess] = []

    def make(*, start: bool = True, client: bool = False, **settings: Any) -> DaemonProcess:
        d = DaemonProcess(new_shm_dir(), **settings)
        made.append(d)
        if client:
            monkeypatch.setenv("TIERCKPT_SOCKET", str(d.socket))
        return d.start() if start else d

    try:
        yield make
    finally:
        for d in made:
            d.cleanup()


@pytest.fixture
def make_ring() -> Iterator[Callable[..., list[DaemonProcess]]]:
    """``make_ring(n, **settings)``: ``n`` daemons that are each other's peers (``helpers.ring``:
    ports, node names, one peer token unless ``token=`` is given), started (``start=False``: not
    yet). Every daemon made is cleaned up after the test."""
    made: list[DaemonProcess] = []

    def make(
        n: int, *, token: str = PEER_TOKEN, start: bool = True, **settings: Any
    ) -> list[DaemonProcess]:
        nodes = ring(n, token=token, prefix="tierckpt-test", **settings)
        made.extend(nodes)
        if start:
            for d in nodes:
                d.start()
        return nodes

    try:
        yield make
    finally:
        for d in made:
            d.cleanup()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files that take longest first: those with a ``network`` test, then those with a
    ``slow`` one, then the rest, each group in collection order (a stable sort: a file's tests
    keep their order). Two workers (addopts' ``-n 2 --dist loadfile``) take files in this order,
    so the long files do not start last and leave one worker running alone at the end."""

    marks: dict[object, set[str]] = {}
    for item in items:
        marks.setdefault(item.path, set()).update(m.name for m in item.iter_markers())
    rank = {p: 0 if "network" in m else 1 if "slow" in m else 2 for p, m in marks.items()}
    items[:] = sorted(items, key=lambda item: rank[item.path])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "daemon_settings(**kw): TIERCKPT_* settings of the daemon fixture"
    )
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if not hasattr(config, "workerinput"):  # the xdist controller (or -n 0), before any worker
        _byte_compile_sources()


def _byte_compile_sources() -> None:
    """Write the ``.pyc`` of our packages and of tests/ once, before any test starts.

    Every daemon, spawned rank and script the suite starts imports our sources afresh; where
    ``PYTHONDONTWRITEBYTECODE`` is set (and the project is installed editable, so pip wrote no
    ``.pyc``) each of those processes compiled them again: ~0.2 CPU-s per daemon, ~0.1 per
    client. Python reads existing ``.pyc`` even with that variable set; compileall writes them
    regardless (atomically, so a second session beside this one is safe), and skips those that
    are up to date. A directory it cannot write (a read-only install) is left as it is.
    """
    import compileall
    import importlib.util

    dirs = {Path(__file__).parent}
    for name in ("tierckpt_core", "tierckpt_client", "tierckpt_daemon", "tierckpt_webhook"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.update(Path(p) for p in spec.submodule_search_locations)
    for d in sorted(dirs):
        compileall.compile_dir(d, quiet=2)


from seaweed import SeaweedS3  # noqa: E402 (the S3 fixtures below)


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedS3]:
    """One real S3 server (SeaweedFS ``weed mini`` on loopback) for the whole test session.

    Fails (never skips) when ``weed`` is missing or does not start: S3 is part of what we test.
    """
    server = SeaweedS3()
    try:
        server.start()
    except Exception as e:
        server.stop()
        pytest.fail(f"cannot start SeaweedFS for the S3 tests: {e}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    """Point this process's S3 clients (CRT, boto3, ``StoreSettings.from_env``) at ``seaweed``."""
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    return seaweed
