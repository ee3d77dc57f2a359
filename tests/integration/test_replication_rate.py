"""Pacing of replication (issue 32): with TIERCKPT_REPLICATION_MAX_RATE, a push of N bytes between
two real daemons on loopback takes at least about N / rate, and with TIERCKPT_PEER_FETCH_MAX_RATE
so does a restore from a peer (lower bounds only: the box may be slow, never fast)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

import pytest
import torch

from tierckpt_client import ClientConfig, DaemonClient

from helpers import DaemonProcess, wait_until
from kit import load, save

RATE = 8_000_000  # bytes/s
DEPTH = 1 << 20
NBYTES = 32 << 20


def _replicated(a: DaemonProcess, ns: str, step: int) -> bool:
    with DaemonClient.from_socket(a.socket) as c:
        info = {s.step: s for s in c.steps(ns)}.get(step)
    return info is not None and bool(info.replicated_to) and not info.replication_pending


@pytest.mark.slow
def test_a_push_at_a_rate_limit_takes_at_least_its_size_over_the_rate(
    make_ring: Callable[..., list[DaemonProcess]],
) -> None:
    # The rate is the receiving side's (it pulls the replica): both nodes get it, as in a chart.
    a, b = make_ring(2, replication_max_rate=str(RATE), replication_inflight_bytes=str(DEPTH))
    state = {"w": torch.randn(NBYTES // 4, generator=torch.Generator().manual_seed(1))}
    t0 = time.monotonic()
    save("job", 1, state, node=a)
    wait_until("step 1 replicated to B", lambda: _replicated(a, "job", 1), 120)
    took = time.monotonic() - t0
    # Unpaced, these 32 MiB cross loopback in well under a second; paced, the bucket lets one depth
    # through at once and the rest at the rate: >= (N - depth) / rate = 4.06 s. 0.9 of it for the
    # clock's granularity; no upper bound (a loaded machine is slower, never faster).
    floor = 0.9 * (NBYTES - DEPTH) / RATE
    assert took >= floor, f"a {NBYTES}-byte push at {RATE} B/s took {took:.2f}s < {floor:.2f}s"
    with DaemonClient.from_socket(b.socket) as c:
        got = {s.step: s for s in c.steps("job")}
    assert 1 in got and sum(f.length for f in got[1].files) >= NBYTES


@pytest.mark.slow
def test_a_restore_from_a_peer_at_its_fetch_limit_takes_at_least_its_size_over_the_rate(
    make_ring: Callable[..., list[DaemonProcess]],
) -> None:
    """TIERCKPT_PEER_FETCH_MAX_RATE paces what a restore fetches (the push itself is unpaced)."""
    nbytes = 16 << 20
    a, _b = make_ring(2, peer_fetch_max_rate=str(RATE), replication_inflight_bytes=str(DEPTH))
    state = {"w": torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(2))}
    save("job", 1, state, node=a)
    wait_until("step 1 replicated to B", lambda: _replicated(a, "job", 1), 120)
    a.kill()  # a replacement node: its memory tier is gone
    shutil.rmtree(a.shm_dir)
    a.start()
    # The daemon fetches the step from B into its memory first (no direct read by the trainer).
    config = ClientConfig.from_env(socket=a.socket, restore_direct="off")
    t0 = time.monotonic()
    step, out = load("job", {"w": torch.zeros(nbytes // 4)}, node=a, config=config)
    took = time.monotonic() - t0
    assert step == 1 and torch.equal(out["w"], state["w"])
    floor = 0.9 * (nbytes - DEPTH) / RATE  # 1.77 s
    assert took >= floor, f"a {nbytes}-byte restore at {RATE} B/s took {took:.2f}s < {floor:.2f}s"
