"""The commit across nodes travels in a tree (TIERCKPT_COMMIT_FANOUT): the decider prepares and
tells at most ``fanout`` nodes, each relaying to its part of the rest. Five real daemons with a
fan-out of 2: the decider's two children each relay to one more node. A relay that stops
answering fails the save naming it, and nothing torn is left: the prepares it passed on late are
aborted once their decider says it never committed them, and the next save commits everywhere."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from commit_kit import latest, step_dirs, until

from tierckpt_client import DaemonClient
from tierckpt_core.errors import TierCkptError
from tierckpt_core.protocol import CommitRequest

from helpers import DaemonProcess, ring, running
from kit import seal_bytes

pytestmark = pytest.mark.slow

TOKEN = "peer-token-for-the-tests-0123456789"
NS = "tree"


@pytest.fixture(scope="module")
def five() -> Iterator[list[DaemonProcess]]:
    """Five daemons for the module's tests (started once: a ring of five is most of a test's
    time). Each test commits under a namespace of its own, and leaves every node answering (a
    node it stops, it continues, and its last save commits on all five)."""
    nodes = ring(
        5,
        token=TOKEN,
        replicas=0,
        prefix="tierckpt-test",
        capacity="128M",
        commit_fanout=2,
        peer_timeout_s=3,
    )
    with running(nodes) as ds:
        yield sorted(ds, key=lambda d: str(d.name))  # the order the decider splits them in


def _save(nodes: list[DaemonProcess], step: int, attempt: str, ns: str = NS) -> CommitRequest:
    placed = {}
    for rank, d in enumerate(nodes):
        name, _ = seal_bytes(d, ns, step, attempt, rank, 10_000)
        placed[name] = str(d.name)
    return CommitRequest(
        files=sorted(placed), metadata={"step": step}, world_size=len(nodes), nodes=placed
    )


def test_a_commit_relayed_through_a_tree_reaches_every_node(five: list[DaemonProcess]) -> None:
    decider = five[0]
    req = _save(five, 1, "a1")
    with DaemonClient.from_socket(decider.socket) as c:
        c.commit(NS, 1, "a1", req)
    assert [latest(d, NS) for d in five] == [1] * 5
    for d in five:
        with DaemonClient.from_socket(d.socket) as c:
            assert c.metadata(NS, 1) == {"step": 1}  # holders, and the others from a holder


@pytest.mark.parametrize("stopped", ["relay", "relayed"])
def test_a_relay_that_stops_answering_fails_the_save_and_leaves_nothing_torn(
    five: list[DaemonProcess], stopped: str
) -> None:
    ns = f"{NS}-{stopped}"  # the shared ring: a namespace of its own
    decider = five[0]
    req = _save(five, 1, "a1", ns)
    with DaemonClient.from_socket(decider.socket) as c:
        c.commit(ns, 1, "a1", req)
    # The decider's children are five[1] and five[3]; five[1] relays to five[2].
    relay, relayed = five[1], five[2]
    frozen = relay if stopped == "relay" else relayed
    req = _save(five, 2, "a2", ns)
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        with DaemonClient.from_socket(decider.socket) as c, pytest.raises(TierCkptError) as e:
            c.commit(ns, 2, "a2", req)
        # The failure names the node that did not answer: the relay itself, or the relay and
        # the participant below it.
        assert f"failed at {relay.name}" in str(e.value)
        if stopped == "relayed":
            assert str(relayed.name) in str(e.value)
        assert [latest(d, ns) for d in five if d is not frozen] == [1] * 4
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    # Whatever the frozen node passed on late is prepared and in doubt: its decider says it
    # never committed it, so it is aborted; no node ever shows step 2.
    until(
        "the late prepares to be aborted",
        lambda: all(not step_dirs(d, 2, ns) for d in five),
        60,
        every=0.3,
    )
    assert [latest(d, ns) for d in five] == [1] * 5
    req = _save(five, 3, "a3", ns)
    with DaemonClient.from_socket(decider.socket) as c:
        c.commit(ns, 3, "a3", req)
    assert [latest(d, ns) for d in five] == [3] * 5


def _save_alone(d: DaemonProcess, step: int) -> None:
    seal_bytes(d, NS, step, f"s{step}", 0, 10_000)
    with DaemonClient.from_socket(d.socket) as c:
        c.commit(
            NS, step, f"s{step}", CommitRequest(files=["r00000.data"], metadata={}, world_size=1)
        )


def test_latest_asks_the_ring_neighbours_and_everyone_only_when_they_know_nothing() -> None:
    nodes = ring(7, token=TOKEN, replicas=0, prefix="tierckpt-test", capacity="64M")
    with running(nodes) as ds:
        ds = sorted(ds, key=lambda d: str(d.name))
        # From node 0, the ring is nodes 1..6: with no replicas its neighbours are the two
        # after it (1, 2) and the two before it (6, 5); nodes 3 and 4 are far.
        reader, near, far = ds[0], ds[1], ds[3]
        _save_alone(far, 1)
        with DaemonClient.from_socket(reader.socket) as c:  # no neighbour knows NS: everyone
            assert [(s.step, s.peers) for s in c.candidates(NS)] == [(1, [far.name])]
        _save_alone(near, 2)
        with DaemonClient.from_socket(reader.socket) as c:  # a neighbour knows NS: it alone
            assert [(s.step, s.peers) for s in c.candidates(NS)] == [(2, [near.name])]


def test_candidates_ask_the_nodes_of_the_steps_shares_not_every_member() -> None:
    nodes = ring(7, token=TOKEN, replicas=0, prefix="tierckpt-test", capacity="64M")
    with running(nodes) as ds:
        ds = sorted(ds, key=lambda d: str(d.name))
        # A step across nodes 0 and 1, decided by node 0. From node 0 the ring neighbours are
        # nodes 1, 2 and 6, 5; nodes 3 and 4 hold nothing of the step and are far.
        reader, holder, far = ds[0], ds[1], ds[3]
        req = _save([reader, holder], 1, "a1")
        with DaemonClient.from_socket(reader.socket) as c:
            c.commit(NS, 1, "a1", req)
        far.kill()  # a member that holds nothing of the step stops answering
        before = len(reader.log_path.read_text(errors="replace"))
        with DaemonClient.from_socket(reader.socket) as c:
            got = [(s.step, s.in_memory, s.peers) for s in c.candidates(NS)]
        assert got == [(1, True, [holder.name])]  # whole: its other share is on node 1
        # Whether the step is whole was asked of the node its record names for the other share,
        # not of every member: the stopped one was never asked (the reader logs a peer that
        # does not answer).
        asked = reader.log_path.read_text(errors="replace")[before:]
        assert far.name not in asked
