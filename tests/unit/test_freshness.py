"""The per-namespace times behind the "seconds since the last committed/durable step" gauges."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt_daemon.tier.freshness import MAX_NAMESPACES, Freshness
from tierckpt_daemon.tier.records import StepRecord


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ages_grow_and_reset() -> None:
    clock = Clock()
    f = Freshness(clock=clock)
    assert f.ages() == {}
    f.committed("a")
    clock.now += 30
    assert f.ages() == {"a": (30.0, None)}
    f.durable("a")
    clock.now += 5
    f.committed("a")
    assert f.ages() == {"a": (0.0, 5.0)}


def test_cardinality_is_bounded_by_the_most_recently_active_namespaces() -> None:
    clock = Clock()
    f = Freshness(clock=clock)
    for i in range(MAX_NAMESPACES + 10):
        f.committed(f"ns{i}")
        clock.now += 1
    # ns0..ns9 were pushed out; ns10 is the oldest kept until it is active again.
    assert "ns9" not in f.ages() and "ns10" in f.ages()
    f.durable("ns10")
    f.committed("late")  # pushes out the least recently active one: ns11, not ns10
    ages = f.ages()
    assert len(ages) == MAX_NAMESPACES
    assert {"ns10", "late", "ns12"} <= ages.keys() and "ns11" not in ages


def test_seed_takes_the_newest_times_of_own_steps_not_replicas(tmp_path: Path) -> None:
    clock = Clock()
    f = Freshness(clock=clock)

    def rec(
        ns: str,
        step: int,
        committed: float,
        durable: float | None,
        origin: str | None,
        attempt: str = "0123456789abcdef.1",
    ) -> StepRecord:
        return StepRecord(
            ns, step, attempt, tmp_path, committed_at=committed, durable_at=durable, origin=origin
        )

    f.seed(
        [
            rec("a", 2, 900.0, None, None),
            rec("a", 1, 800.0, 850.0, None),
            rec("b", 1, 990.0, None, "10.0.0.2:8474"),  # a peer's step: not this node's progress
            rec("a", 1, 995.0, None, None, "h0123456789abcde"),  # hydrated for a reader
        ]
    )
    assert f.ages() == {"a": (100.0, 150.0)}


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Freshness(0)


def test_due_steps_count_commits_for_the_persistent_tier_until_one_is_durable(
    tmp_path: Path,
) -> None:
    """What TierckptNoDurableStep alerts on: the count, not the time, so that a job that saves
    every 15 minutes and persists every 5th step (75 minutes apart) is not taken for stuck."""
    f = Freshness(clock=Clock())
    f.committed("a", due=True)
    for _ in range(4):
        f.committed("a")  # steps the policy keeps in memory only
    assert f.due_steps() == {"a": 1}
    f.committed("a", due=True)
    f.committed("a", due=True)
    assert f.due_steps() == {"a": 3}
    f.durable("a")
    assert f.due_steps() == {"a": 0}
    f.committed("a", due=True)
    assert f.due_steps() == {"a": 1}
    # After a restart: the job's steps still queued count, from its newest durable one on.
    seeded = Freshness(clock=Clock())
    recs = [
        StepRecord("b", s, "0123456789abcdef.1", tmp_path, committed_at=900.0 + s)
        for s in range(1, 4)
    ]
    recs[0].durable_at = 902.5
    recs[1].persist_pending = recs[2].persist_pending = True
    seeded.seed(recs)
    assert seeded.due_steps() == {"b": 2}
    # A pending step older than a durable one counts no more once that one is seeded (as live).
    seeded = Freshness(clock=Clock())
    recs[0].persist_pending, recs[0].durable_at = True, None
    recs[1].persist_pending, recs[1].durable_at = False, 903.0
    seeded.seed(recs)
    assert seeded.due_steps() == {"b": 1}
