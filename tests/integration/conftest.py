"""Fixtures of the integration tests that run against a persistent tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from seaweed import SeaweedS3

from helpers import DaemonProcess, started


@pytest.fixture(params=["file", "s3"])
def tier_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A persistent tier of each kind: a directory, and a prefix of a real S3 bucket (SeaweedFS)."""
    if request.param == "file":
        yield f"file://{tmp_path / 'store'}"
    else:
        server: SeaweedS3 = request.getfixturevalue("s3_env")
        yield f"s3://{server.bucket}/{request.node.name.replace('[', '-').replace(']', '')}"


@pytest.fixture
def node(tier_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[DaemonProcess]:
    """A daemon persisting to ``tier_url`` (keep_last 2), this process's clients pointed at it."""
    with started(persist_url=tier_url, keep_last=2) as d:
        monkeypatch.setenv("TIERCKPT_SOCKET", str(d.socket))
        yield d
