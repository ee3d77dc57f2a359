"""The daemon's housekeeping sweep (an asyncio task, not a thread: the threads' death hook never
sees it) goes on after any error, and an unexpected one is counted as a background failure."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter

from tierckpt_daemon.api import app as app_module
from tierckpt_daemon.failures import ThreadFailures


def test_a_sweep_that_fails_is_logged_counted_and_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(app_module, "SWEEP_INTERVAL_S", 0.01)
    calls: list[int] = []

    def sweep() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("tmpfs hiccup")  # expected kind: logged only
        if len(calls) == 2:
            raise KeyError("a bug")  # unexpected: logged and counted

    counter = Counter("t_failures_total", "t", ["thread"], registry=CollectorRegistry())
    node = SimpleNamespace(
        service=SimpleNamespace(sweep=sweep), failures=ThreadFailures(counter), persister=None
    )

    async def run() -> None:
        task = asyncio.create_task(app_module._sweeper(node))  # type: ignore[arg-type]
        for _ in range(500):
            await asyncio.sleep(0.01)
            if len(calls) >= 4:
                break
        task.cancel()

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert len(calls) >= 4  # the sweep goes on after both
    assert counter.labels(thread="sweeper")._value.get() == 1
    assert node.failures.failed() == ["sweeper failed (KeyError: 'a bug'); it goes on"]
    assert "may not expire" in caplog.text and "tmpfs hiccup" in caplog.text
