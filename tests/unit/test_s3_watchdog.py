"""The deadline that bounds CRT calls (objectstore.watchdog) and TIERCKPT_S3_MIN_RATE."""

from __future__ import annotations

import threading
import time

import pytest

from tierckpt_core.errors import PersistentTierError
from tierckpt_core.objectstore import StoreSettings
from tierckpt_core.objectstore.watchdog import Abandoned, Deadline, Expired, run_with_deadline


def test_a_call_that_keeps_making_progress_runs_past_any_single_allowance() -> None:
    def work(d: Deadline) -> int:
        for i in range(5):
            d.extend(f"chunk {i}", 0.5)
            time.sleep(0.15)
        return 42

    t0 = time.monotonic()
    assert run_with_deadline(work, "start", 0.5) == 42
    assert time.monotonic() - t0 >= 0.7  # longer than one allowance, and not cut short


def test_errors_of_the_work_reach_the_caller() -> None:
    def work(d: Deadline) -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        run_with_deadline(work, "start", 5)


def test_a_stalled_step_expires_and_the_helper_stops_at_its_next_step() -> None:
    release = threading.Event()
    exits: list[bool] = []
    effects: list[str] = []
    buf = bytearray(4)

    def work(d: Deadline) -> None:
        d.extend("writing chunk 0", 0.2)
        release.wait(10)  # a blocking call that never returns in time
        try:
            with d.exclusive():
                buf[:] = b"late"  # must never happen: the caller gave up on us
        except Abandoned:
            effects.append("no write")
        d.extend("completing the upload", 5)
        effects.append("completed")  # must never happen either

    t0 = time.monotonic()
    with pytest.raises(Expired, match=r"writing chunk 0 did not finish within 0\.2s"):
        run_with_deadline(work, "start", 5, on_exit=exits.append)
    assert time.monotonic() - t0 < 2
    release.set()
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exits == [True] and effects == ["no write"] and buf == bytearray(4)


def test_min_rate_setting() -> None:
    assert StoreSettings.from_env({}).min_rate == 4 << 20
    assert StoreSettings.from_env({"TIERCKPT_S3_MIN_RATE": "500K"}).min_rate == 500 << 10
    assert StoreSettings.from_env({"TIERCKPT_S3_MIN_RATE": "2MiB"}).min_rate == 2 << 20
    assert StoreSettings.from_env({"TIERCKPT_S3_MIN_RATE": "1000"}).min_rate == 1000
    for bad in ("fast", "0", "-1M"):
        with pytest.raises(PersistentTierError, match="TIERCKPT_S3_MIN_RATE"):
            StoreSettings.from_env({"TIERCKPT_S3_MIN_RATE": bad})
