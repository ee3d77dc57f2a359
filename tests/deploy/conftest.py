"""Fixtures of the deploy tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from webhook_server import Webhook, start_webhook


@pytest.fixture(name="start_webhook")
def _start_webhook(tmp_path: Path) -> Iterator[Callable[..., Webhook]]:
    """Start ``tierckpt-webhook`` (extra command-line arguments as given); stopped at the end."""
    started: list[Webhook] = []

    def start(*args: str) -> Webhook:
        hook = start_webhook(tmp_path, *args)
        started.append(hook)
        return hook

    yield start
    for hook in started:
        hook.stop()
