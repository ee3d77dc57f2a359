"""Fixtures of the network-fault tests: a :class:`cluster.Cluster` of daemons, each in its own
network namespace (see netlab.py). The whole directory skips, saying why, where namespaces with
nftables rules cannot be made (not root, no ``ip``, no ``nft``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import netlab
from cluster import SETTINGS, TOKEN, Cluster
from helpers import other_workers_paused


@pytest.fixture(scope="module", autouse=True)
def _alone() -> Iterator[None]:
    """No other test worker runs a test while a file of these scenarios runs: their bounds (a
    2 s peer timeout, a save's bound of 4.5 s) are tight enough that a test beside them on a
    2-core machine breaks them (seen: a healthy save's prepare timed out at load 20)."""
    with other_workers_paused():
        yield


@pytest.fixture(scope="session")
def network_lab() -> None:
    """Skip where namespaces cannot be made; remove those a crashed earlier run left."""
    why = netlab.unavailable()
    if why is not None:
        pytest.skip(f"network-fault tests skipped: {why}")
    netlab.reap_stale()


@pytest.fixture
def make_cluster(network_lab: None, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(n, delays={node: ms}, **settings)``: ``n`` started daemons, each in its own
    namespace on one bridge, persisting to a ``file://`` directory; ``delays`` puts a latency
    proxy in front of those nodes' daemons. Everything is removed after the test, however it
    ends (daemons, proxies, namespaces)."""
    labs: list[netlab.Lab] = []
    made: list[Cluster] = []

    def make(n: int, *, delays: dict[int, float] | None = None, **settings: Any) -> Cluster:
        delays = delays or {}
        lab = netlab.Lab(n)
        labs.append(lab)
        lab.up()
        persist = tmp_path / f"persist-{len(labs)}"
        nodes = lab.daemons(
            token=TOKEN,
            proxied=frozenset(delays),
            persist_url=persist.as_uri(),
            **{**SETTINGS, **settings},
        )
        c = Cluster(lab, nodes, persist)
        made.append(c)
        for i, ms in delays.items():
            lab.delay(i, ms)
        for d in nodes:
            d.start()
        return c

    try:
        yield make
    finally:
        for c in made:
            print(f"\n{c.summary()}")
            for d in [*c.nodes, *c.retired]:
                d.cleanup()
        for lab in labs:
            lab.down()
