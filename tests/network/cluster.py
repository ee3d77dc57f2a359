"""Saves across nodes and what the network-fault tests check after each fault (issue 32).

A :class:`Cluster` is a :class:`netlab.Lab` with one daemon per node and a ``file://`` persistent
tier. A save is what a job with one rank per node does: each rank seals its file with its own
node's daemon (over the Unix socket, which no network fault touches), then the coordinator's
daemon (the decider) commits the step across the nodes, over the faulty network. The checks:

- ``outcomes``: what each node holds of a step once it has settled: ``committed`` (listed),
  ``aborted`` (not listed, nothing prepared left), or ``undecided`` (prepared, in doubt);
- ``settled_alike``: every node ends up with the same outcome, and the one the save reported
  (acknowledged: committed everywhere; failed: committed nowhere);
- ``durable``: the step's ``COMMITTED`` marker in the persistent tier, and every file there
  bit-exact;
- ``restored``: each node's share read back from its memory bit-exact (a replaced node hydrates
  it first, from the replica holder).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_core import layout
from tierckpt_core.errors import NamespaceNotFoundError, PeerUnavailableError, TierCkptError
from tierckpt_core.launcher import DaemonProcess
from tierckpt_core.protocol import CommitRequest

from kit import seal_bytes
from netlab import Lab, wait_for

NS = "job"
TOKEN = "network-tests-peer-token-0123456789abcdef"
PEER_TIMEOUT_S = 2.0
# The longest a save touched by one unreachable participant may take (docs/design.md, "Bounded
# waits"): one peer timeout, plus a margin for the rest of the save on a loaded 2-core machine.
SAVE_BOUND_S = PEER_TIMEOUT_S + 2.5
# A committed step is durable this long after the network heals (uploads, and the decider's
# check of every share, retried with backoff).
DURABLE_AFTER_HEAL_S = 30.0
SETTLE_S = 45.0  # every node takes the decision this long after the heal (in doubt: asks)
SIZE = 40_000  # bytes per rank's file

SETTINGS = {
    "capacity": "128M",
    "keep_last": 16,  # no step leaves memory during a test: a node's outcome is what it lists
    "replicas": 1,
    "peer_timeout_s": PEER_TIMEOUT_S,
    "peer_list_timeout_s": PEER_TIMEOUT_S,  # "latest"'s wait for the peers' listings
    "lease_ttl_s": 30,
    "log_level": "DEBUG",
}


@dataclass
class Save:
    step: int
    attempt: str
    written: dict[str, bytes]  # file name -> bytes
    acknowledged: bool
    error: str | None
    seconds: float

    def __repr__(self) -> str:
        what = "acknowledged" if self.acknowledged else f"failed ({self.error})"
        return f"<save of step {self.step}: {what} after {self.seconds:.2f}s>"


@dataclass
class Cluster:
    lab: Lab
    nodes: list[DaemonProcess]
    persist: Path
    saves: dict[int, Save] = field(default_factory=dict)
    retired: list[DaemonProcess] = field(default_factory=list)  # replaced (cleaned up too)
    overran: list[str] = field(default_factory=list)  # waits longer than their bound
    waits: list[str] = field(default_factory=list)  # every bounded wait, as measured
    last_commit: float = 0.0  # when the last save's commit call returned (monotonic)

    def bounded(self, what: str, seconds: float, bound: float = SAVE_BOUND_S) -> None:
        """Note a wait longer than ``bound``; :meth:`check_bounds` fails on it at the end of the
        test, after the checks of consistency have run."""
        self.waits.append(f"{what} {seconds:.2f}s")
        if seconds > bound:
            self.overran.append(f"{what} took {seconds:.1f}s (bound {bound:g}s)")

    def summary(self) -> str:
        """What a test saw: each save, and each wait over its bound (printed at teardown)."""
        saves = ", ".join(repr(s) for s in self.saves.values())
        return f"{self.lab.tag}: {saves}; {self.waits}; overran: {self.overran or 'none'}"

    def check_bounds(self) -> None:
        assert not self.overran, "unbounded blocking: " + "; ".join(self.overran)

    def replace(self, i: int) -> DaemonProcess:
        """Node ``i`` lost for good (daemon killed, memory gone) and replaced by a new, empty
        daemon under the same name in the same namespace; the new one, started."""
        old = self.nodes[i]
        old.lose_node()
        self.retired.append(old)
        new = self.lab.replacement(old)
        self.nodes[i] = new
        return new.start()

    def save(
        self,
        step: int,
        *,
        decider: int = 0,
        gone: frozenset[int] = frozenset(),
        idle: float | None = None,
        replicated: bool = False,
    ) -> Save:
        """One save across every node: each rank's file sealed on its node, then committed by
        the ``decider``'s daemon. Returns how it ended and how long the commit took. The ranks
        of the nodes in ``gone`` seal nothing (their node vanished), but the commit still names
        their files on their node. ``idle``: the commit starts this long after the previous
        save's commit returned (its peer calls then were the last). ``replicated``: the save
        counts as done only once every share has its replica (the writer's
        ``wait="replicated"``)."""
        attempt = f"a{step}"
        written: dict[str, bytes] = {}
        where: dict[str, str] = {}
        for rank, d in enumerate(self.nodes):
            if rank in gone:
                name, data = f"r{rank:05d}.data", b""
            else:
                name, data = seal_bytes(d, NS, step, attempt, rank, SIZE)
            written[name] = data
            where[name] = str(d.name)
        req = CommitRequest(
            files=sorted(written), metadata={"step": step}, world_size=len(self.nodes), nodes=where
        )
        if idle is not None:
            time.sleep(max(0.0, self.last_commit + idle - time.monotonic()))
        start = time.monotonic()
        error = None
        try:
            with DaemonClient(ClientConfig(socket=self.nodes[decider].socket)) as c:
                c.commit(NS, step, attempt, req)
                if replicated:
                    c.wait_replicated(NS, step, timeout_s=60)
        except TierCkptError as e:
            error = str(e)
        self.last_commit = time.monotonic()
        s = Save(step, attempt, written, error is None, error, self.last_commit - start)
        self.saves[step] = s
        return s

    def save_in_background(self, step: int, *, decider: int = 0) -> Future[Save]:
        """:meth:`save` on a thread of its own, to fault the network while it runs."""
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"save-{step}")
        try:
            return pool.submit(self.save, step, decider=decider)
        finally:
            pool.shutdown(wait=False)

    def prepared(self, i: int, step: int) -> bool:
        """Whether node ``i`` has prepared an attempt of ``step`` (and promised to keep it)."""
        ns_dir = self.nodes[i].shm_dir / "ns" / NS
        return bool(list(ns_dir.glob(f"{step:012d}-*/MANIFEST.prepared.json")))

    def candidates(self, i: int) -> tuple[list[int], float]:
        """The steps node ``i`` offers a restore (its ``candidates``, a restore's first call),
        and how long it took to answer."""
        start = time.monotonic()
        with DaemonClient(ClientConfig(socket=self.nodes[i].socket, timeout_s=120)) as c:
            try:
                steps = sorted(s.step for s in c.candidates(NS))
            except (NamespaceNotFoundError, PeerUnavailableError):  # no whole step to offer
                steps = []  # (PeerUnavailableError: none now, and a node that holds part of one
                # does not answer)
        return steps, time.monotonic() - start

    def logged(self, i: int, text: str) -> bool:
        """Whether node ``i``'s daemon has logged ``text``."""
        return text in self.nodes[i].log_path.read_text(errors="replace")

    def replicated(self, step: int, timeout: float = DURABLE_AFTER_HEAL_S) -> None:
        """Wait until every node's share of ``step`` has its replica on a peer."""

        def missing() -> list[str]:
            out = []
            for d in self.nodes:
                with DaemonClient(ClientConfig(socket=d.socket, timeout_s=30)) as c:
                    if not c.step(NS, step).replicated_to:
                        out.append(str(d.name))
            return out

        wait_for(f"every share of step {step} to have its replica", lambda: not missing(),
                 timeout, every=0.25)  # fmt: skip

    # -- what each node holds ----------------------------------------------------------------

    def outcome(self, d: DaemonProcess, step: int) -> str:
        """``committed``, ``aborted`` or ``undecided`` (prepared, not yet decided) on ``d``."""
        with DaemonClient(ClientConfig(socket=d.socket, timeout_s=30)) as c:
            listed = {s.step for s in c.steps(NS) if s.state.value != "writing"}
        if step in listed:
            return "committed"
        ns_dir = d.shm_dir / "ns" / NS
        dirs = list(ns_dir.glob(f"{step:012d}-*")) if ns_dir.is_dir() else []
        if any((p / "MANIFEST.prepared.json").exists() for p in dirs):
            return "undecided"
        return "aborted"

    def outcomes(self, step: int) -> list[str]:
        return [self.outcome(d, step) for d in self.nodes]

    def settled_alike(self, step: int, timeout: float = SETTLE_S) -> str:
        """Wait until no node is in doubt about ``step``; assert that all agree with each other
        and with what the save reported. Returns the outcome."""
        got = wait_for(
            f"every node to settle step {step}",
            lambda: (o := self.outcomes(step)) and "undecided" not in o and o,
            timeout,
            every=0.25,
        )
        assert len(set(got)) == 1, f"split outcome of step {step}: {self._by_node(got)}"
        save = self.saves.get(step)
        if save is not None:
            want = "committed" if save.acknowledged else "aborted"
            assert got[0] == want, f"{save!r}, but every node holds it {got[0]}"
        return str(got[0])

    def _by_node(self, values: list[str]) -> dict[str, str]:
        return {str(d.name): v for d, v in zip(self.nodes, values, strict=True)}

    def latest(self) -> list[int | None]:
        """Each node's newest committed step."""
        out: list[int | None] = []
        for d in self.nodes:
            with DaemonClient(ClientConfig(socket=d.socket, timeout_s=30)) as c:
                steps = [s.step for s in c.steps(NS) if s.state.value != "writing"]
            out.append(max(steps) if steps else None)
        return out

    # -- durability and restores --------------------------------------------------------------

    def is_durable(self, step: int) -> bool:
        return (self.persist / layout.marker_key(NS, step)).is_file()

    def durable(self, step: int, timeout: float = DURABLE_AFTER_HEAL_S) -> None:
        """Wait for ``step``'s ``COMMITTED`` marker; then every file in the persistent tier is
        the bytes that were saved."""
        wait_for(f"step {step} to become durable (its COMMITTED marker)",
                 lambda: self.is_durable(step), timeout, every=0.25)  # fmt: skip
        for name, data in self.saves[step].written.items():
            stored = (self.persist / layout.file_key(NS, step, name)).read_bytes()
            assert stored == data, f"step {step}'s {name} in the persistent tier differs"

    def restored(self, step: int, *, hydrate: bool = False) -> None:
        """Each node's share of ``step`` read back from its memory tier, bit-exact (``hydrate``:
        brought into memory first, as a restore does on a node that lost it)."""
        written = self.saves[step].written
        for rank, d in enumerate(self.nodes):
            name = f"r{rank:05d}.data"
            with DaemonClient(ClientConfig(socket=d.socket, timeout_s=60)) as c:
                if hydrate:
                    c.hydrate(NS, step, [name])
                pin = c.pin(NS, step)
                try:
                    (record,) = [f for f in pin.step.files if f.name == name]
                    assert record.length == len(written[name]), f"{d.name}: {record}"
                    with open(pin.paths[name], "rb") as f:
                        got = f.read(record.length)
                finally:
                    c.unpin(NS, step, pin.pin_id)
            assert got == written[name], f"{d.name} restored a torn or wrong {name} of step {step}"
