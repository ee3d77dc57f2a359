"""The token bucket that paces replication and peer fetches (issue 32), on an injected clock:
what it lets through at once, what it makes wait, and that concurrent takers share one rate."""

from __future__ import annotations

import threading

import pytest

from tierckpt_daemon.config import DaemonSettings
from tierckpt_daemon.peers.pacing import TokenBucket, paced_readinto

MB = 1_000_000


class Clock:
    """A clock that moves only when someone sleeps on it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        with self._lock:
            self.slept.append(s)


def bucket(clock: Clock, rate: float = 10 * MB, depth: int = 1 * MB) -> TokenBucket:
    return TokenBucket(rate, depth, clock=clock, sleep=clock.sleep)


def test_the_first_depth_goes_at_once_then_the_rate_paces() -> None:
    c = Clock()
    b = bucket(c)
    b.take(MB)  # a full bucket: no wait
    assert c.slept == []
    b.take(MB)  # empty: 1 MB at 10 MB/s
    assert c.slept == [pytest.approx(0.1)]
    c.now += 0.1  # the sleep happened
    b.take(MB // 2)  # the level is at 0 again: half a MB more is 50 ms
    assert c.slept[-1] == pytest.approx(0.05)


def test_idle_time_refills_but_never_past_the_depth() -> None:
    c = Clock()
    b = bucket(c)
    b.take(MB)
    c.now += 60.0  # a minute idle: still only one depth of credit
    b.take(MB)
    assert c.slept == []
    b.take(MB)
    assert c.slept == [pytest.approx(0.1)]


def test_takers_at_once_queue_behind_each_other() -> None:
    """Four takers booking at the same instant wait 0, 0.1, 0.2, 0.3 s: together, one rate."""
    c = Clock()
    b = bucket(c)
    waits = sorted(b.reserve(MB) for _ in range(4))
    assert waits == [0.0, pytest.approx(0.1), pytest.approx(0.2), pytest.approx(0.3)]
    # N bytes through an empty bucket take (N - depth) / rate, whoever takes them.
    c2 = Clock()
    b2 = bucket(c2)
    threads = [threading.Thread(target=b2.take, args=(MB,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert max(c2.slept) == pytest.approx((8 * MB - MB) / (10 * MB))


def test_a_paced_reader_reads_at_most_the_depth_and_pays_for_what_it_got() -> None:
    c = Clock()
    b = bucket(c, depth=1000)
    asked: list[int] = []

    def readinto(view: memoryview) -> int:
        asked.append(len(view))
        return min(len(view), 600)  # a short read

    read = paced_readinto(readinto, b)
    buf = memoryview(bytearray(4096))
    assert read(buf) == 600 and asked == [1000]
    assert read(buf) == 600  # 1200 taken of a 1000 depth: 200 bytes owed
    assert c.slept == [pytest.approx(200 / (10 * MB))]
    assert paced_readinto(readinto, None) is readinto


@pytest.mark.parametrize(
    ("rate", "depth", "n"),
    [(0, 10, 1), (-1, 10, 1), (1, 0, 1)],
)
def test_bad_settings_are_refused(rate: float, depth: int, n: int) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        TokenBucket(rate, depth)


def test_a_take_beyond_the_depth_is_refused() -> None:
    b = bucket(Clock(), depth=10)
    with pytest.raises(ValueError, match="1 to 10 bytes"):
        b.take(11)


def test_the_settings_parse_sizes_and_name_a_bad_rate() -> None:
    s = DaemonSettings(replication_max_rate="200M", replication_inflight_bytes="2M")
    assert s.replication_inflight_bytes == 2 << 20 and s.peer_fetch_max_rate is None
    with pytest.raises(ValueError, match="fast"):
        DaemonSettings(replication_max_rate="fast")
