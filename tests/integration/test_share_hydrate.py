"""A replaced node that holds only a replica of another node's share of a step spanning nodes
still brings back its own share when asked to hydrate the step with no files named (issue 32,
item 5): before, "already here" ended the hydration and the reader fetched by name."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import httpx
from commit_kit import read_step

from tierckpt_client import DaemonClient
from tierckpt_core.protocol import CommitRequest

from helpers import DaemonProcess, wait_until
from kit import seal_bytes

TOKEN = "peer-token-for-the-share-tests-0123456789"
NS = "job"


def _held(d: DaemonProcess) -> dict[str, bytes]:
    return read_step(d, 1)


def test_a_node_holding_only_a_replica_of_another_share_hydrates_its_own(
    make_ring: Callable[..., list[DaemonProcess]],
) -> None:
    a, b = make_ring(2, token=TOKEN, log_level="INFO")
    assert a.name and b.name
    data = dict([seal_bytes(a, NS, 1, "s1", 0, 30_000), seal_bytes(b, NS, 1, "s1", 1, 30_000)])
    req = CommitRequest(
        files=sorted(data),
        metadata={"what": "test"},
        world_size=2,
        nodes={"r00000.data": a.name, "r00001.data": b.name},
    )
    with DaemonClient.from_socket(a.socket) as c:
        c.commit(NS, 1, "s1", req)

    def replicated() -> bool:
        steps = []
        for d in (a, b):
            with DaemonClient.from_socket(d.socket) as c:
                steps += [s for s in c.steps(NS) if s.step == 1]
        return len(steps) == 2 and all(s.replicated_to and not s.replication_pending for s in steps)

    wait_until("each share replicated to the other node", replicated, 60)
    b.kill()  # node B is replaced: its memory is gone
    shutil.rmtree(b.shm_dir)
    b.start()
    # A's share comes to B first (as a push of A's does): B holds the step, but not its own
    # share.
    with httpx.Client(
        base_url=f"http://{b.name}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    ) as http:
        resp = http.post(f"/v1/peer/namespaces/{NS}/steps/1/pull", json={"origin": a.name})
    assert resp.status_code == 200, resp.text
    assert set(_held(b)) == {"r00000.data"}
    with DaemonClient.from_socket(b.socket) as c:
        info = c.hydrate(NS, 1)
    assert "r00001.data" in {f.name for f in info.files}
    assert _held(b)["r00001.data"] == data["r00001.data"]  # from A's replica, verified
