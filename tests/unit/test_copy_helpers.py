"""The client's copy helpers (tierckpt_client.dcp._helpers): torch's spinning OpenMP workers
let go before a restore's copy, and started again by torch's next parallel op."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

from tierckpt_client.dcp import _helpers


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.fixture
def two_threads() -> Iterator[None]:
    if _helpers._omp_pause() is None:
        pytest.skip("no OpenMP runtime with omp_pause_resource_all in this process")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_quiet_openmp_lets_the_workers_go_and_torch_starts_them_again() -> None:
    a = torch.rand(1 << 22)
    b = a * 2  # a parallel op: its worker now waits (spinning) for the next one
    with_worker = _threads()
    _helpers.quiet_openmp()
    deadline = time.monotonic() + 30
    while not with_worker - (without := _threads()) and time.monotonic() < deadline:
        time.sleep(0.01)  # a thread that exits leaves /proc a moment after it said so
    assert with_worker - without  # the worker left
    c = a * 2  # torch starts a worker again: a new thread
    assert torch.equal(b, c)
    assert _threads() - without
    _helpers.quiet_openmp()  # twice in a row, and with no pool: nothing to do, no error
    _helpers.quiet_openmp()
    assert torch.equal(a * 2, b)
