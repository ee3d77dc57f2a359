"""The kit of the tests of the commit across nodes (test_global_commit, test_commit_persist,
test_decision_delivery, test_commit_tree): real daemons on a ring, their files sealed through the
real API, and the two phases driven through the real peer routes as the deciding daemon drives
them, so that a daemon can be killed at an exact point of the protocol."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from tierckpt_client import DaemonClient
from tierckpt_core.manifest import (
    FileRecord,
    RingRecord,
    Share,
    StepManifest,
    metadata_digest,
    table_digest,
)
from tierckpt_core.metadata_blob import canonical_json

from helpers import DaemonProcess
from kit import seal_bytes

TOKEN = "peer-token-for-the-tests-0123456789"
NS = "job"
METADATA = {"what": "test"}


def latest(d: DaemonProcess, ns: str = NS) -> int | None:
    """``d``'s newest committed step of ``ns`` (None: none)."""
    with DaemonClient.from_socket(d.socket) as c:
        steps = [s.step for s in c.steps(ns) if s.state.value != "writing"]
    return max(steps) if steps else None


def read_step(d: DaemonProcess, step: int) -> dict[str, bytes]:
    """The files ``d`` holds of ``step`` (its share): name -> bytes, read through a pin."""
    with DaemonClient.from_socket(d.socket) as c:
        pin = c.pin(NS, step)
        try:
            out = {}
            for f in pin.step.files:
                with open(pin.paths[f.name], "rb") as fh:
                    out[f.name] = fh.read(f.length)
            return out
        finally:
            c.unpin(NS, step, pin.pin_id)


def step_dirs(d: DaemonProcess, step: int, ns: str = NS) -> list[str]:
    """The attempt directories of ``step`` in ``d``'s memory tier (none: all reclaimed)."""
    ns_dir = d.shm_dir / "ns" / ns
    return sorted(p.name for p in ns_dir.iterdir() if p.name.startswith(f"{step:012d}-"))


def peer(d: DaemonProcess) -> httpx.Client:
    """A client of ``d``'s peer routes, with the ring's token."""
    return httpx.Client(
        base_url=f"http://{d.name}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    )


def prepare_answer(
    coordinator: DaemonProcess,
    d: DaemonProcess,
    step: int,
    attempt: str,
    name: str,
    participants: list[str],
    world_size: int = 2,
) -> dict[str, Any]:
    """``d``'s answer to the prepare of its file ``name``, as the decider would send it."""
    with peer(d) as http:
        resp = http.post(
            f"/v1/peer/namespaces/{NS}/steps/{step}/attempts/{attempt}/prepare",
            json={
                "coordinator": coordinator.name,
                "participants": participants,
                "files": [name],
                "world_size": world_size,
            },
        )
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def prepare(
    coordinator: DaemonProcess,
    d: DaemonProcess,
    step: int,
    attempt: str,
    name: str,
    participants: list[str],
) -> list[FileRecord]:
    """``d`` prepares its file ``name``: the records it answers with, marked as held on ``d``
    (as the decider's manifest lists them)."""
    answer = prepare_answer(coordinator, d, step, attempt, name, participants)
    return [
        FileRecord.model_validate(f).model_copy(update={"node": d.name}) for f in answer["files"]
    ]


def decide(
    decider: DaemonProcess,
    step: int,
    attempt: str,
    files: list[FileRecord],
    *,
    via: DaemonProcess | None = None,
    persist: bool = False,
    relay: list[str] | None = None,
) -> None:
    """The decision of ``decider`` (its manifest of ``files``, 2 ranks) sent to ``via`` (the
    decider itself by default: its MANIFEST.json is the commit point), which takes it."""
    manifest = StepManifest(
        namespace=NS,
        step=step,
        attempt=attempt,
        world_size=2,
        files=files,
        metadata=METADATA,
        coordinator=decider.name,
    )
    body: dict[str, Any] = {"manifest": manifest.model_dump(mode="json"), "persist": persist}
    if relay is not None:
        body["relay"] = relay
    with peer(via or decider) as http:
        resp = http.post(
            f"/v1/peer/namespaces/{NS}/steps/{step}/attempts/{attempt}/commit", json=body
        )
    assert resp.status_code == 200, resp.text


def until(what: str, check: Callable[[], Any], timeout: float = 30.0, every: float = 0.2) -> Any:
    """Poll ``check`` every ``every`` seconds until it returns something true, and return that;
    fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def decided_without(
    four: list[DaemonProcess], away: DaemonProcess, *, persist: bool = False
) -> dict[str, bytes]:
    """Step 1 over ``four``, each node one rank's file, prepared everywhere and then decided by
    the third node (the holders of its share table and metadata: it and the fourth) while
    ``away`` is down: it learns the decision only by asking, once back. Returns the files."""
    every = [str(d.name) for d in four]
    decider, holder = four[2], four[3]
    shares: dict[str, Share] = {}
    written: dict[str, bytes] = {}
    for rank, d in enumerate(four):
        name, data = seal_bytes(d, NS, 1, "s1", rank, 30_000)
        written[name] = data
        got = prepare_answer(decider, d, 1, "s1", name, every, world_size=4)
        shares[str(d.name)] = Share(digest=got["share_digest"], files=[name], bytes=30_000)
    away.kill()  # prepared, then gone before it learns the decision
    manifest = StepManifest(
        namespace=NS,
        step=1,
        attempt="s1",
        world_size=4,
        files=[],
        metadata=METADATA,
        coordinator=decider.name,
        ring=RingRecord(
            shares=shares,
            shares_digest=table_digest(shares),
            metadata_digest=metadata_digest(canonical_json(METADATA)),
            metadata_holders=[str(decider.name), str(holder.name)],
        ),
    )
    with peer(decider) as http:  # the decider decides; the others ask it (in doubt)
        resp = http.post(
            f"/v1/peer/namespaces/{NS}/steps/1/attempts/s1/commit",
            json={"manifest": manifest.model_dump(mode="json"), "persist": persist},
        )
    assert resp.status_code == 200, resp.text
    for d in four:
        if d is not away:
            until(f"{d.name} to take the decision", lambda d=d: latest(d) == 1, 90)
    return written
