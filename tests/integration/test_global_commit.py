"""The commit across nodes and its crash cases, with real daemons on a ring.

Files are sealed through the daemons' real API (as ranks do); the crash cases drive the two phases
through the real peer routes (as the deciding daemon does), so that a daemon can be SIGKILLed at
an exact point of the protocol. After each: "latest" on every node is the previous complete step
or the new one, never a torn step; leftovers are reclaimed; the next save works.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
from commit_kit import (
    METADATA,
    NS,
    TOKEN,
    decide,
    decided_without,
    latest,
    peer,
    prepare,
    read_step,
    step_dirs,
    until,
)

from tierckpt_client import DaemonClient
from tierckpt_core.errors import TierCkptError
from tierckpt_core.manifest import (
    StepManifest,
)
from tierckpt_core.protocol import CommitRequest
from tierckpt_daemon.metrics import namespace_label

from helpers import DaemonProcess, ring, running
from kit import seal_bytes


@pytest.fixture
def nodes() -> Iterator[list[DaemonProcess]]:
    with running(ring(2, token=TOKEN, replicas=0, prefix="tierckpt-test", capacity="256M")) as ds:
        yield ds


def _save(a: DaemonProcess, b: DaemonProcess, step: int, attempt: str) -> dict[str, bytes]:
    """Ranks 0 on ``a`` and 1 on ``b`` seal their files; the result maps name -> bytes."""
    return dict(
        [seal_bytes(a, NS, step, attempt, 0, 50_000), seal_bytes(b, NS, step, attempt, 1, 50_000)]
    )


def _commit_request(a: DaemonProcess, b: DaemonProcess) -> CommitRequest:
    assert a.name and b.name
    return CommitRequest(
        files=["r00000.data", "r00001.data"],
        metadata={"what": "test"},
        world_size=2,
        nodes={"r00000.data": a.name, "r00001.data": b.name},
    )


def _since_commit(d: DaemonProcess) -> list[str]:
    """The node's ``tierckpt_seconds_since_committed_step`` samples of the namespace."""
    text = httpx.get(f"http://{d.name}/metrics", timeout=10).text
    label = namespace_label(NS)  # hashed: /metrics shows no names by default
    pattern = rf'^tierckpt_seconds_since_committed_step\{{namespace="{label}"\}} \S+$'
    return re.findall(pattern, text, re.MULTILINE)


def test_a_step_is_committed_on_every_node_with_its_global_record(
    nodes: list[DaemonProcess],
) -> None:
    a, b = nodes
    data = _save(a, b, 1, "s1")
    assert not any(_since_commit(d) for d in nodes)  # sealed is not committed
    with DaemonClient.from_socket(a.socket) as c:
        info = c.commit(NS, 1, "s1", _commit_request(a, b))
    assert info.state.value == "committed"
    # Both nodes count it as the namespace's last commit (the gauge alerts watch), not only the
    # decider.
    assert all(_since_commit(d) for d in nodes)
    # Each node holds its own rank's file, committed, and knows where the other one is.
    assert read_step(a, 1) == {"r00000.data": data["r00000.data"]}
    assert read_step(b, 1) == {"r00001.data": data["r00001.data"]}
    for d in nodes:
        with peer(d) as http:
            doc = StepManifest.model_validate(http.get(f"/v1/peer/namespaces/{NS}/steps/1").json())
        assert doc.coordinator == a.name
        # Its own file's record, and of the other node's share an entry (names, records' digest).
        assert doc.ring is not None
        assert {n: doc.ring.node_of(n) for n in doc.ring.names()} == {
            "r00000.data": a.name,
            "r00001.data": b.name,
        }
        assert [f.node for f in doc.files] == [d.name]
        assert all(f.checksum for f in doc.files)  # taken at prepare


def test_a_participant_down_at_commit_fails_the_save_and_commits_nothing(
    nodes: list[DaemonProcess],
) -> None:
    a, b = nodes
    _save(a, b, 1, "s1")
    with DaemonClient.from_socket(a.socket) as c:
        c.commit(NS, 1, "s1", _commit_request(a, b))
    _save(a, b, 2, "s2")
    b.kill()
    with DaemonClient.from_socket(a.socket) as c, pytest.raises(TierCkptError) as err:
        c.commit(NS, 2, "s2", _commit_request(a, b))
    assert b.name in str(err.value) and "nothing was committed" in str(err.value)
    assert latest(a) == 1 and step_dirs(a, 2) == []  # aborted and reclaimed on the decider
    b.start()
    assert latest(b) == 1 and step_dirs(b, 2) == []  # an unprepared attempt: reclaimed at start
    data = _save(a, b, 3, "s3")
    with DaemonClient.from_socket(a.socket) as c:
        c.commit(NS, 3, "s3", _commit_request(a, b))
    assert latest(a) == latest(b) == 3
    assert read_step(b, 3) == {"r00001.data": data["r00001.data"]}


def test_a_participant_killed_after_prepare_takes_the_decision_after_restart(
    nodes: list[DaemonProcess],
) -> None:
    a, b = nodes
    assert a.name and b.name
    _save(a, b, 1, "s1")
    with DaemonClient.from_socket(a.socket) as c:
        c.commit(NS, 1, "s1", _commit_request(a, b))
    data = _save(a, b, 2, "s2")
    both = [a.name, b.name]
    files = prepare(a, a, 2, "s2", "r00000.data", both) + prepare(
        a, b, 2, "s2", "r00001.data", both
    )
    b.kill()  # prepared, then gone before the decision reaches it
    assert latest(a) == 1  # prepared is not committed
    decide(a, 2, "s2", files)  # the decider decides (its MANIFEST.json is the commit point)
    assert latest(a) == 2
    b.start()
    # In doubt after the restart, B shows step 1 until it has asked the decider; it may have
    # asked already when start() returns (a slow start), so only the outcome is asserted.
    assert latest(b) in (1, 2)
    until("node B to take the decision", lambda: latest(b) == 2)
    assert read_step(b, 2) == {"r00001.data": data["r00001.data"]}


def test_the_decider_killed_before_deciding_aborts_everywhere(nodes: list[DaemonProcess]) -> None:
    a, b = nodes
    assert a.name and b.name
    _save(a, b, 1, "s1")
    with DaemonClient.from_socket(a.socket) as c:
        c.commit(NS, 1, "s1", _commit_request(a, b))
    _save(a, b, 2, "s2")
    both = [a.name, b.name]
    prepare(a, a, 2, "s2", "r00000.data", both)
    prepare(a, b, 2, "s2", "r00001.data", both)
    a.kill()  # the decider dies between the prepares and its decision
    a.start()
    until("node A to abort its undecided attempt", lambda: step_dirs(a, 2) == [])
    until("node B to learn that step 2 was never committed", lambda: step_dirs(b, 2) == [])
    assert latest(a) == latest(b) == 1
    _save(a, b, 3, "s3")
    with DaemonClient.from_socket(a.socket) as c:
        c.commit(NS, 3, "s3", _commit_request(a, b))
    assert latest(a) == latest(b) == 3


def test_a_prepared_participant_waits_while_its_decider_is_unreachable(
    nodes: list[DaemonProcess],
) -> None:
    a, b = nodes
    assert a.name and b.name
    _save(a, b, 2, "s2")
    prepare(a, b, 2, "s2", "r00001.data", [a.name, b.name])
    a.kill()  # partition: B cannot ask anyone how step 2 ended
    time.sleep(9)  # longer than a participant waits before it asks
    assert step_dirs(b, 2) != []  # never guessed away
    assert latest(b) is None  # and never shown


@pytest.fixture
def four() -> Iterator[list[DaemonProcess]]:
    """Four nodes in name order (the participants' order)."""
    nodes = ring(
        4, token=TOKEN, replicas=0, prefix="tierckpt-test", capacity="256M", log_level="INFO"
    )
    with running(nodes) as ds:
        yield sorted(ds, key=lambda d: d.name)


def test_a_participant_in_doubt_takes_the_decision_from_a_node_that_keeps_no_share_table(
    four: list[DaemonProcess],
) -> None:
    """Four nodes; the decider and the next keep the step's share table, the other two its
    digest. A participant killed after prepare comes back while the decider is down: the first
    participant it asks holds the decision without the table, so it fetches the table from the
    holder left (checked against the digest) and takes the decision."""
    d0, d1, decider, _ = four  # holders: the decider and d3; d0 and d1 keep the digest only
    decided_without(four, d1)
    (d0_record,) = (d0.shm_dir / "ns" / NS).glob("000000000001-*/MANIFEST.json")
    assert '"shares":' not in d0_record.read_text()  # the table's digest only
    decider.kill()
    d1.start()  # asks the decider (down), then d0, which has no table: the table from d3
    until("node d1 to take the decision", lambda: latest(d1) == 1, 90)
    assert f"attempt s1 was committed (as {d0.name} says)" in d1.log()
    (d1_record,) = (d1.shm_dir / "ns" / NS).glob("000000000001-*/MANIFEST.json")
    assert '"shares":' not in d1_record.read_text()


def test_a_holder_in_doubt_takes_the_decision_while_no_other_holder_answers(
    four: list[DaemonProcess],
) -> None:
    """Four nodes; the decider and the next (d3) keep the share table. d3 is killed after
    prepare and the decider after deciding: the only nodes holding the decision keep the
    table's digest, and the only other holder is down. d3 does not wait for it forever: it
    commits its share as prepared, with the digest only; once the decider is back every node
    finds the step whole and serves its metadata (the table and the metadata from the decider,
    checked against the digests)."""
    _, _, decider, d3 = four
    written = decided_without(four, d3)
    decider.kill()
    d3.start()  # asks the decider (down), d0 and d1 (the digest only): no table anywhere
    until("the holder d3 to take the decision", lambda: latest(d3) == 1, 90)
    assert "committing this node's share as prepared" in d3.log()
    assert read_step(d3, 1) == {"r00003.data": written["r00003.data"]}
    decider.start()
    for d in four:
        with DaemonClient.from_socket(d.socket) as c:
            assert c.metadata(NS, 1) == METADATA
            assert 1 in [s.step for s in c.candidates(NS)]
