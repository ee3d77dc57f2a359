"""Commits across nodes under real network faults (issue 32): each node's daemon in its own
network namespace, faults from nftables rules inside a node's namespace, latency from a TCP proxy
(netlab.py). Three nodes; node 0 decides every save (its rank is the coordinator).

Every scenario checks, once the network heals: no split outcome (every node holds each step
committed, or none does, as the save reported), no torn restore (each node's share reads back
bit-exact), every committed step durable (its ``COMMITTED`` marker and bit-exact files in the
persistent tier), saving resumes, and bounded blocking (a save, or a restore's first call, that
one unreachable node touches ends within ``SAVE_BOUND_S``; checked last, after consistency).
docs/reliability.md says what each scenario showed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster import SAVE_BOUND_S, Cluster, Save
from job import Job
from netlab import PORT, wait_for

pytestmark = pytest.mark.network

MakeCluster = Callable[..., Cluster]
SLOW_NODE_MS = 600  # latency in front of node 2, so that a fault lands between two prepares
# What that latency adds to a save's own work: a prepare's and a decision's round trips.
SLOW_SAVE_S = 4 * SLOW_NODE_MS / 1000


def _healthy(c: Cluster, step: int) -> None:
    """A save on a healthy network: acknowledged, committed everywhere, durable, restored."""
    s = c.save(step)
    assert s.acknowledged, s
    assert c.settled_alike(step) == "committed"
    c.durable(step)
    c.restored(step)


def _fault_while_saving(c: Cluster, fault: Callable[[], None], *, wait: float = 0.0) -> Save:
    """Save step 2 on its own thread; once node 1 has prepared it (node 2, behind its slow link,
    has not yet), ``wait`` seconds more, then ``fault()``. Returns how the save ended, its time
    noted against the bound (a slow node's round trips added)."""
    pending = c.save_in_background(2)
    wait_for("node 1 to prepare step 2", lambda: c.prepared(1, 2), 30, every=0.01)
    time.sleep(wait)
    fault()
    s = pending.result(timeout=120)
    c.bounded("the save of step 2", s.seconds, SAVE_BOUND_S + SLOW_SAVE_S)
    return s


def _committed_durable_restored(c: Cluster, step: int) -> None:
    """Once healed: every node holds ``step`` committed, it is durable and restores bit-exact;
    the next save works; no wait was over its bound."""
    assert c.settled_alike(step) == "committed"
    c.durable(step)
    c.restored(step)
    _healthy(c, step + 1)
    c.check_bounds()


def test_a_participant_unreachable_before_the_prepare(make_cluster: MakeCluster) -> None:
    """Node 2 blackholed, then (another save) its link down, before the save reaches it: the
    save fails, nothing is committed anywhere, and the next save after the heal works."""
    c = make_cluster(3)
    _healthy(c, 1)
    for step, fault, heal in (
        (2, lambda: c.lab.blackhole(2), lambda: c.lab.heal(2)),
        (4, lambda: c.lab.link(2, up=False), lambda: c.lab.link(2, up=True)),
    ):
        fault()
        s = c.save(step)
        assert not s.acknowledged, s
        assert str(c.nodes[2].name) in str(s.error) and "nothing was committed" in str(s.error)
        c.bounded(f"the save of step {step}", s.seconds)
        heal()
        assert c.settled_alike(step) == "aborted"
        _healthy(c, step + 1)
    assert c.latest() == [5, 5, 5]
    c.restored(1, hydrate=True)  # evicted from memory by then (keep 2): from the tiers
    c.check_bounds()


def test_a_participant_unreachable_after_its_prepare(make_cluster: MakeCluster) -> None:
    """Node 1 prepares, then is blackholed while the decider still waits for node 2 (slow):
    the decision cannot reach it. The save is acknowledged (every node prepared); node 1 takes
    the decision after the heal, and the step becomes durable."""
    c = make_cluster(3, delays={2: SLOW_NODE_MS})
    _healthy(c, 1)
    # 0.2 s: node 1's answer is on its way to the decider; node 2's is not
    s = _fault_while_saving(c, lambda: c.lab.blackhole(1), wait=0.2)
    assert s.acknowledged, s
    assert c.outcome(c.nodes[1], 2) == "undecided"  # in doubt, never guessed
    c.lab.heal(1)
    _committed_durable_restored(c, 2)


def test_a_participant_unreachable_after_the_decision(make_cluster: MakeCluster) -> None:
    """Node 2 blackholed right after an acknowledged save, before its share has a replica: a
    restore's first call elsewhere answers within the bound (without the step while node 2's
    share is on no reachable node and not durable; with it once durable), and once healed every
    share gets its replica."""
    c = make_cluster(3)
    s = c.save(1)
    assert s.acknowledged, s
    c.lab.blackhole(2)
    for i in (0, 1):
        steps, seconds = c.candidates(i)
        assert steps in ([], [1])
        c.bounded(f"candidates on node {i}", seconds)
    c.durable(1)  # the persistent tier is not behind the fault
    for i in (0, 1):
        steps, seconds = c.candidates(i)
        assert steps == [1]
        c.bounded(f"candidates on node {i} once durable", seconds)
    c.lab.heal(2)
    assert c.settled_alike(1) == "committed"
    c.replicated(1)
    c.restored(1)
    _healthy(c, 2)
    c.check_bounds()


def test_the_decider_unreachable_during_the_decision(make_cluster: MakeCluster) -> None:
    """The decider blackholed after node 1 prepared, while node 2's prepare is under way (slow
    link): it cannot learn that node 2 prepared, nor tell anyone how the save ended. The save
    fails; both participants stay in doubt (they never guess) while the decider is unreachable,
    and abort once they can ask it."""
    c = make_cluster(3, delays={2: SLOW_NODE_MS})
    _healthy(c, 1)
    s = _fault_while_saving(c, lambda: c.lab.blackhole(0))
    assert not s.acknowledged, s
    wait_for("node 2 to prepare step 2", lambda: c.prepared(2, 2), 30)
    time.sleep(7.5)  # longer than a prepared participant waits before it asks its decider
    assert c.outcome(c.nodes[1], 2) == c.outcome(c.nodes[2], 2) == "undecided"
    c.lab.heal(0)
    assert c.settled_alike(2) == "aborted"
    assert c.latest() == [1, 1, 1]
    _healthy(c, 3)
    c.check_bounds()


def test_a_one_way_partition_during_the_decision(make_cluster: MakeCluster) -> None:
    """Node 1 prepares, then hears nothing more from the decider (it can still send to it):
    the decision does not reach it, and its own questions get no answer. It settles by asking
    node 2 while the partition lasts; after the heal the step must still become durable."""
    c = make_cluster(3, delays={2: SLOW_NODE_MS})
    _healthy(c, 1)
    # 0.2 s: node 1's answer is on its way to the decider; node 2's is not
    s = _fault_while_saving(c, lambda: c.lab.deaf_to(1, [0]), wait=0.2)
    assert s.acknowledged, s
    wait_for("node 1 to take the decision from node 2", lambda: c.outcome(c.nodes[1], 2)
             == "committed", 30, every=0.25)  # fmt: skip
    # It learnt the outcome from node 2, the other participant (the decider's answers cannot
    # reach it): the decision it took must still make its share durable.
    assert c.logged(1, f"attempt a2 was committed (as {c.nodes[2].name} says)")
    c.lab.heal(1)
    _committed_durable_restored(c, 2)


def test_delay_and_loss(make_cluster: MakeCluster) -> None:
    """Every node behind 25 ms of latency each way, nodes 1 and 2 losing 5 % of their packets:
    saves may fail, but every node agrees on each, and each acknowledged one is durable and
    restores. Two saves come after the peers' connections were idle just under the server's
    keep-alive (5 s): on a healthy link they must not fail."""
    # No replicas: a commit's are then the only calls between the daemons, and the idle time of
    # their pooled connections is the time between two saves.
    c = make_cluster(3, delays={0: 25, 1: 25, 2: 25}, replicas=0)
    _healthy(c, 1)
    for i in (1, 2):
        c.lab.loss(i, 5)
    for step in range(2, 6):
        c.save(step)
    c.lab.heal_all()
    for step in range(2, 6):
        c.settled_alike(step)
        if c.saves[step].acknowledged:
            c.durable(step)
            c.restored(step)
    acked = [s for s in range(2, 6) if c.saves[s].acknowledged]
    print(f"delay and loss: acknowledged {acked} of steps 2-5; {list(c.saves.values())}")
    _healthy(c, 6)
    for step in (7, 8):  # the peers' pooled connections idle just under 5 s, the link healthy
        s = c.save(step, idle=4.96)
        assert s.acknowledged, s
        assert c.settled_alike(step) == "committed"
    assert c.latest() == [8, 8, 8]


def test_a_node_lost_for_good_and_replaced(make_cluster: MakeCluster) -> None:
    """Node 2 vanishes from the network (blackholed, its daemon and memory gone) the moment a
    save that waited for its replicas returned: the next save, which touches it, fails. A new,
    empty daemon under the same name takes its place: it restores its share of the first step
    bit-exact (from the replica holder), and saving resumes."""
    c = make_cluster(3)
    s = c.save(1, replicated=True)  # done once every share has its replica
    assert s.acknowledged, s
    c.lab.blackhole(2)  # at once
    c.nodes[2].lose_node()
    s = c.save(2, gone=frozenset({2}))
    assert not s.acknowledged, s
    c.bounded("the save of step 2", s.seconds)
    for i in (0, 1):
        steps, seconds = c.candidates(i)
        assert 1 in steps
        c.bounded(f"candidates on node {i}", seconds)
    c.lab.heal(2)
    c.replace(2)
    c.restored(1, hydrate=True)
    assert c.settled_alike(1) == "committed"
    c.durable(1)
    assert c.settled_alike(2) == "aborted"
    _healthy(c, 3)
    assert c.latest() == [3, 3, 3]
    c.check_bounds()


def test_a_training_job_saves_through_a_cut_off_daemon(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    """A real job (DCP through the tiered writer, one gloo rank per node, each in its node's
    namespace) saves step after step while node 2's daemon is cut off from the other daemons
    (its peer port blackholed; the ranks' own traffic still flows): those saves fail within the
    bound, every node agrees on every step, saving resumes after the heal, and "latest" restores
    bit-exact on every rank."""
    c = make_cluster(3)
    job = Job(c, tmp_path)
    try:
        for step in (1, 2):
            assert job.save(step).acknowledged, c.saves[step]
        own = c.saves[2].seconds  # DCP's own work in a save (the first one warms up)
        c.lab.blackhole(2, port=PORT)
        for step in (3, 4):
            s = job.save(step)
            assert not s.acknowledged, s
            c.bounded(f"the job's save of step {step}", s.seconds, SAVE_BOUND_S + own)
        c.lab.heal(2)
        for step in (5, 6):
            assert job.save(step).acknowledged, c.saves[step]
        assert job.ask("load") == "loaded 6 ok"
    finally:
        job.close()
    for step in range(1, 7):
        c.settled_alike(step)
    for step in (1, 2, 5, 6):
        c.durable(step)
    assert c.latest() == [6, 6, 6]
    c.check_bounds()
