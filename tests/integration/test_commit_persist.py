"""A step committed across nodes with ``persist=True`` becomes durable however its participants
learnt the decision: from the decider, from another participant while in doubt, or first
without the flag and then again with it (issue 32, item 1). Real daemons on a ring with a
``file://`` persistent tier."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from commit_kit import NS, TOKEN, decide, decided_without, latest, prepare, until

from tierckpt_client import DaemonClient
from tierckpt_core.protocol import CommitRequest

from helpers import DaemonProcess, ring, running
from kit import seal_bytes


def _share_up(root: Path, step: int, name: str) -> bool:
    """A node's share file is in the persistent tier, with the record its uploader writes."""
    where = root / NS / f"step_{step:012d}"
    return (where / name).is_file() and (where / f"{name}.sum.json").is_file()


def _due(d: DaemonProcess) -> float:
    """``tierckpt_due_steps_since_durable`` of ``d`` for the namespace (its only one)."""
    text = httpx.get(f"http://{d.name}/metrics", timeout=10).text
    (line,) = [x for x in text.splitlines() if x.startswith("tierckpt_due_steps_since_durable{")]
    return float(line.rsplit(" ", 1)[1])


def _durable(root: Path, step: int) -> bool:
    return (root / NS / f"step_{step:012d}" / "COMMITTED").is_file()


@pytest.fixture
def tier(tmp_path: Path) -> Path:
    return tmp_path / "tier"


@pytest.fixture
def four(tier: Path) -> Iterator[list[DaemonProcess]]:
    nodes = ring(
        4,
        token=TOKEN,
        replicas=0,
        prefix="tierckpt-test",
        capacity="256M",
        log_level="INFO",
        persist_url=f"file://{tier}",
    )
    with running(nodes) as ds:
        yield sorted(ds, key=lambda d: d.name)


def test_a_participant_that_learns_the_decision_from_another_one_uploads_its_share(
    four: list[DaemonProcess], tier: Path
) -> None:
    """The decider says persist; d1 is down and learns the decision, once back, from d0 (the
    decider is down then), whose own share is already up. d1 must be told the step's flag
    (persist), not d0's remaining upload work (none): else d1's share never reaches the
    persistent tier and the step never becomes durable."""
    d0, d1, decider, _ = four
    decided_without(four, d1, persist=True)
    until("d0's share in the persistent tier", lambda: _share_up(tier, 1, "r00000.data"), 30)
    decider.kill()
    d1.start()  # asks the decider (down), then d0
    until("node d1 to take the decision", lambda: latest(d1) == 1, 90)
    assert f"attempt s1 was committed (as {d0.name} says)" in d1.log()
    until("d1's share in the persistent tier", lambda: _share_up(tier, 1, "r00001.data"), 30)
    decider.start()  # it writes the step's manifest and marker once every share is up
    until("step 1 durable", lambda: _durable(tier, 1), 60)


@pytest.fixture
def two(tier: Path) -> Iterator[list[DaemonProcess]]:
    nodes = ring(2, token=TOKEN, replicas=0, prefix="tierckpt-test", persist_url=f"file://{tier}")
    with running(nodes) as ds:
        yield ds


def test_a_decision_sent_again_with_persist_upgrades_a_step_taken_without_it(
    two: list[DaemonProcess], tier: Path
) -> None:
    """A participant took the decision with persist=False (a wrong answer in doubt); the
    decider's re-send says persist: the participant uploads its share."""

    a, b = two
    assert a.name and b.name
    seal_bytes(a, NS, 2, "s2", 0, 40_000)
    seal_bytes(b, NS, 2, "s2", 1, 40_000)
    both = [a.name, b.name]
    files = prepare(a, a, 2, "s2", "r00000.data", both) + prepare(
        a, b, 2, "s2", "r00001.data", both
    )
    for persist in (False, True):
        decide(a, 2, "s2", files, via=b, persist=persist)
    assert latest(b) == 2
    until("b's share in the persistent tier", lambda: _share_up(tier, 2, "r00001.data"), 30)


def test_a_participant_learns_that_the_step_became_durable(
    two: list[DaemonProcess], tier: Path
) -> None:
    """Each node uploads its share; the decider writes the step's marker. The participant's
    record stayed "committed" for good: a rank on that node waiting for the step to become
    durable (a preemption's save) waited its whole deadline and exited 1, and `tierckpt
    persist --wait` there failed, with the step durable. Asked about the step, the participant
    now reads the marker, and a persist request does not upload its share again."""
    a, b = sorted(two, key=lambda d: d.name or "")
    assert a.name and b.name
    data = dict([seal_bytes(a, NS, 3, "s3", 0, 40_000), seal_bytes(b, NS, 3, "s3", 1, 40_000)])
    req = CommitRequest(
        files=sorted(data),
        metadata={"what": "test"},
        world_size=2,
        nodes={"r00000.data": a.name, "r00001.data": b.name},
        persist=True,
    )
    with DaemonClient.from_socket(a.socket) as ca:
        ca.commit(NS, 3, "s3", req)  # a decides: its trainer is rank 0
        until("step 3 durable in the tier", lambda: _durable(tier, 3), 60)
        assert ca.step(NS, 3).state.value == "durable"
    # The commit across nodes is timed, as one on a node is (the dashboard's latency panel).
    metrics = httpx.get(f"http://{a.name}/metrics", timeout=10).text
    assert "tierckpt_commit_seconds_count 1.0" in metrics, metrics
    share = tier / NS / "step_000000000003" / "r00001.data"
    uploaded = share.stat().st_mtime_ns
    with DaemonClient.from_socket(b.socket) as cb:
        cb.persist(NS, 3)  # what a preemption's wait asks first
        until("b to say step 3 is durable", lambda: cb.step(NS, 3).state.value == "durable", 10)
    time.sleep(0.5)
    assert share.stat().st_mtime_ns == uploaded  # b's share was not sent again

    # Unasked, b reads the marker of its newest such step at its housekeeping sweep (10 s):
    # its due count (TierckptNoDurableStep) restarts only once the step is durable.
    data = dict([seal_bytes(a, NS, 4, "s4", 0, 40_000), seal_bytes(b, NS, 4, "s4", 1, 40_000)])
    with DaemonClient.from_socket(a.socket) as ca:
        ca.commit(NS, 4, "s4", req.model_copy(update={"files": sorted(data)}))
    until("step 4 durable in the tier", lambda: _durable(tier, 4), 60)

    def listed() -> str:
        with DaemonClient.from_socket(b.socket) as cb:  # a listing does not read markers
            return next(s.state.value for s in cb.steps(NS) if s.step == 4)

    # Its share is up: still due here, unless a sweep since has read the marker.
    due = _due(b)
    assert due == 1 or (due == 0 and listed() == "durable"), due

    until("b to learn that step 4 is durable", lambda: listed() == "durable", 30)
    assert _due(b) == 0


def test_the_decider_waits_for_a_slow_share_without_sending_its_own_again(tier: Path) -> None:
    """The decider's upload of a step spanning nodes waits for the other nodes' shares. Each
    look uploaded its own share again (gigabytes, for as long as another node's upload took),
    counted as a failing upload, with a backoff up to two minutes: the step became durable up
    to two minutes after the last share (a network-fault trial: 159 s after an outage ended),
    and `tierckpt persist --wait` said "still queued". Now its share goes once, it looks again
    within seconds, and its status says what it waits for."""
    nodes = ring(2, token=TOKEN, replicas=0, prefix="tierckpt-test", persist_url=f"file://{tier}")
    a, b = sorted(nodes, key=lambda d: d.name or "")
    # b's second file waits 10 s for the rate cap (the first chunk of an idle spell goes at once).
    b.settings["upload_max_rate"] = "4K"
    with running(nodes):
        assert a.name and b.name
        files = dict(
            [
                seal_bytes(a, NS, 4, "s4", 0, 40_000),
                seal_bytes(b, NS, 4, "s4", 1, 40_000),
                seal_bytes(b, NS, 4, "s4", 2, 40_000),
            ]
        )
        req = CommitRequest(
            files=sorted(files),
            metadata={"what": "test"},
            world_size=3,
            nodes={"r00000.data": a.name, "r00001.data": b.name, "r00002.data": b.name},
            persist=True,
        )
        with DaemonClient.from_socket(a.socket) as ca:
            ca.commit(NS, 4, "s4", req)
            own = tier / NS / "step_000000000004" / "r00000.data"
            until("a's share in the tier", own.is_file, 30)
            sent = own.stat().st_mtime_ns

            def waiting() -> list[str]:
                p = ca.status().persistent
                assert p is not None
                return p.waiting

            until("a to say it waits for b's share", lambda: bool(waiting()), 30)
            assert waiting() == [f"{NS}/step 4: waiting for the shares of {b.name} (2 files)"]
            assert ca.status().persistent.healthy is not False  # type: ignore[union-attr]
            until("b's share in the tier", lambda: _share_up(tier, 4, "r00002.data"), 60)
            shared = time.monotonic()
            until("step 4 durable", lambda: _durable(tier, 4), 30)
            assert time.monotonic() - shared < 10.0 + 3.0  # one look (at most 10 s apart)
            assert own.stat().st_mtime_ns == sent  # a's share went once
            assert waiting() == []
            assert ca.step(NS, 4).state.value == "durable"
