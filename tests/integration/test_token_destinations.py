"""The peer token goes to members of the ring only, and a prepared attempt cannot be replaced.

Real daemons on a ring; an address that is not a member is a listener on loopback that records
every byte it is sent. A trainer's commit naming it, a peer's prepare naming it as decider, and a
prepared attempt whose decider left the ring must never make a daemon send it anything (every peer
request carries the cluster-wide token). With the token, a prepare or decision that does not match
an attempt in flight is refused, and the real decider's commit still goes through.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from commit_kit import read_step

from tierckpt_client import DaemonClient
from tierckpt_core.errors import NamespaceNotFoundError, NotAMemberError
from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_core.metadata_blob import unpack_metadata
from tierckpt_core.protocol import CommitRequest
from tierckpt_daemon.peers.commit import IN_DOUBT_AFTER_S, RESOLVE_INTERVAL_S

from helpers import DaemonProcess, free_port, ring, running, wait_until
from kit import seal_bytes

TOKEN = "peer-token-for-the-tests-0123456789"
NS = "job"


class Listener:
    """A TCP listener on 127.0.0.1 that accepts anything and records every byte it receives."""

    def __init__(self, port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", port))
        self._sock.listen(16)
        self._sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.connections = 0
        self._data = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def received(self) -> bytes:
        with self._lock:
            return bytes(self._data)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(2.0)
        with conn:
            try:
                while chunk := conn.recv(65536):
                    with self._lock:
                        self._data += chunk
            except OSError:
                pass  # the sender gave up (its timeout) or we did: what came is recorded

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    ear = Listener()
    try:
        yield ear
    finally:
        ear.close()


@pytest.fixture
def nodes() -> Iterator[list[DaemonProcess]]:
    with running(ring(2, token=TOKEN, replicas=0, prefix="tierckpt-test", capacity="256M")) as ds:
        yield ds


def _seal(d: DaemonProcess, step: int, attempt: str, rank: int) -> bytes:
    return seal_bytes(d, NS, step, attempt, rank, 50_000)[1]


def _commit(a: DaemonProcess, step: int, attempt: str, nodes: list[str]) -> None:
    names = [f"r{rank:05d}.data" for rank in range(len(nodes))]
    req = CommitRequest(
        files=names,
        metadata={"what": "test"},
        world_size=len(nodes),
        nodes=dict(zip(names, nodes, strict=True)),
    )
    with DaemonClient.from_socket(a.socket) as c:
        c.commit(NS, step, attempt, req)


def _peer_post(d: DaemonProcess, step: int, attempt: str, what: str, body: Any) -> httpx.Response:
    with httpx.Client(
        base_url=f"http://{d.name}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    ) as http:
        return http.post(
            f"/v1/peer/namespaces/{NS}/steps/{step}/attempts/{attempt}/{what}", json=body
        )


def _prepare(
    d: DaemonProcess,
    step: int,
    attempt: str,
    coordinator: str,
    participants: list[str],
    files: list[str],
) -> httpx.Response:
    return _peer_post(
        d,
        step,
        attempt,
        "prepare",
        {"coordinator": coordinator, "participants": participants, "files": files, "world_size": 2},
    )


def _latest(d: DaemonProcess) -> int | None:
    with DaemonClient.from_socket(d.socket) as c:
        try:
            steps = [s.step for s in c.steps(NS) if s.state.value != "writing"]
        except NamespaceNotFoundError:  # it holds nothing of the namespace now
            return None
    return max(steps) if steps else None


def _read(d: DaemonProcess, step: int) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The files ``d`` holds of ``step`` and the step's metadata, as a peer reads them."""
    out = read_step(d, step)
    with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
        doc = http.get(f"http://{d.name}/v1/peer/namespaces/{NS}/steps/{step}").json()
    return out, unpack_metadata(StepManifest.model_validate(doc).metadata, where="test")


def _step_dirs(d: DaemonProcess, step: int) -> list[str]:
    ns_dir = d.shm_dir / "ns" / NS
    return sorted(p.name for p in ns_dir.iterdir() if p.name.startswith(f"{step:012d}-"))


def test_a_commit_naming_a_node_outside_the_ring_fails_and_sends_it_nothing(
    nodes: list[DaemonProcess], listener: Listener
) -> None:
    a, b = nodes
    assert a.name and b.name
    _seal(a, 1, "s1", 0)
    # A trainer with only A's socket names the listener as the node of a file.
    with pytest.raises(NotAMemberError) as err:
        _commit(a, 1, "s1", [a.name, listener.address])
    assert listener.address in str(err.value) and "not a member of the ring" in str(err.value)
    time.sleep(1.0)  # anything sent would have arrived by now
    assert listener.connections == 0 and listener.received == b""  # no token, no port probe
    assert _latest(a) is None
    # The ring's own commits are unaffected.
    data = _seal(b, 2, "s2", 1)
    _seal(a, 2, "s2", 0)
    _commit(a, 2, "s2", [a.name, b.name])
    assert _latest(a) == _latest(b) == 2
    assert _read(b, 2)[0] == {"r00001.data": data}


def test_a_prepare_naming_a_decider_outside_the_ring_is_refused_and_never_dialed(
    nodes: list[DaemonProcess], listener: Listener
) -> None:
    a, b = nodes
    assert a.name and b.name
    data = _seal(b, 1, "s1", 1)
    _seal(a, 1, "s1", 0)
    files = ["r00001.data"]
    resp = _prepare(b, 1, "s1", listener.address, [listener.address, b.name], files)
    assert resp.status_code == 400, resp.text
    assert resp.json()["code"] == "not_a_member" and listener.address in resp.json()["detail"]
    resp = _prepare(b, 1, "s1", a.name, [a.name, b.name, listener.address], files)
    assert resp.status_code == 400 and resp.json()["code"] == "not_a_member", resp.text
    # Longer than a prepared attempt waits before its resolver asks the decider, twice over.
    time.sleep(IN_DOUBT_AFTER_S + 2 * RESOLVE_INTERVAL_S)
    assert listener.connections == 0 and listener.received == b""
    # The attempt was left as it was: its real decider commits it.
    _commit(a, 1, "s1", [a.name, b.name])
    assert _latest(b) == 1 and _read(b, 1)[0] == {"r00001.data": data}


def test_an_attempt_whose_decider_left_the_ring_is_aborted_without_dialing_it() -> None:
    a, b = ring(2, token=TOKEN, replicas=0, prefix="tierckpt-test", capacity="256M")
    b.settings["decider_gone_s"] = 2
    with running([a, b]):
        assert a.name and b.name
        _seal(a, 1, "s1", 0)
        _seal(b, 1, "s1", 1)
        both = [a.name, b.name]
        for d, name in ((a, "r00000.data"), (b, "r00001.data")):
            assert _prepare(d, 1, "s1", a.name, both, [name]).status_code == 200
        a.kill()  # the decider is gone before deciding, and the ring is reconfigured without it
        b.settings["peers"] = b.name
        b.restart()
        port = int(a.name.rsplit(":", 1)[1])
        ear = Listener(port)  # something else now answers at the old decider's address
        try:
            wait_until(
                "B to abort the attempt of its departed decider", lambda: not _step_dirs(b, 1)
            )
            assert ear.connections == 0 and ear.received == b""
        finally:
            ear.close()
        assert _latest(b) is None
        assert "has not been a member of the ring" in b.log()


def test_a_decider_back_under_another_address_still_settles_the_attempt() -> None:
    """The decider decided, then its node came back as another member (a pod's new IP): the
    participant whose decider left finds the decision there instead of aborting its share."""
    a, b = ring(2, token=TOKEN, replicas=0, prefix="tierckpt-test", capacity="256M")
    b.settings["decider_gone_s"] = 2
    with running([a, b]):
        assert a.name and b.name
        _seal(a, 1, "s1", 0)
        data = _seal(b, 1, "s1", 1)
        both = [a.name, b.name]
        prepared: list[FileRecord] = []
        for d, name in ((a, "r00000.data"), (b, "r00001.data")):
            resp = _prepare(d, 1, "s1", a.name, both, [name])
            assert resp.status_code == 200, resp.text
            prepared += [
                FileRecord.model_validate(f).model_copy(update={"node": d.name})
                for f in resp.json()["files"]
            ]
        b.kill()  # prepared, then gone before the decision reaches it
        manifest = StepManifest(
            namespace=NS,
            step=1,
            attempt="s1",
            world_size=2,
            files=prepared,
            metadata={"what": "test"},
            coordinator=a.name,
        )
        decision = {"manifest": manifest.model_dump(mode="json"), "persist": False}
        resp = _peer_post(a, 1, "s1", "commit", decision)  # A decides
        assert resp.status_code == 200, resp.text
        a.kill()
        new = f"127.0.0.1:{free_port()}"  # A's node is back under another address
        a.settings.update(port=new.rsplit(":", 1)[1], node_name=new, peers=f"{new},{b.name}")
        b.settings["peers"] = f"{new},{b.name}"
        a.start()
        b.start()
        wait_until("B to take the decision from A's new address", lambda: _latest(b) == 1)
        assert _read(b, 1) == ({"r00001.data": data}, {"what": "test"})


def test_a_forged_prepare_or_decision_cannot_replace_an_attempt_in_flight(
    nodes: list[DaemonProcess],
) -> None:
    a, b = nodes
    assert a.name and b.name
    _seal(a, 1, "s1", 0)
    data = _seal(b, 1, "s1", 1)
    both = [a.name, b.name]
    prepared: list[FileRecord] = []
    for d, name in ((a, "r00000.data"), (b, "r00001.data")):  # the real decider, A, prepares
        resp = _prepare(d, 1, "s1", a.name, both, [name])
        assert resp.status_code == 200, resp.text
        prepared += [
            FileRecord.model_validate(f).model_copy(update={"node": d.name})
            for f in resp.json()["files"]
        ]
    # A token holder prepares B's share again with no files, or as another decider ...
    resp = _prepare(b, 1, "s1", a.name, both, [])
    assert resp.status_code == 400 and resp.json()["code"] == "protocol", resp.text
    resp = _prepare(b, 1, "s1", b.name, both, ["r00001.data"])
    assert resp.status_code == 409 and resp.json()["code"] == "step_state", resp.text
    # ... and decides it with metadata of its own, as a decider that did not prepare it.
    forged = StepManifest(
        namespace=NS,
        step=1,
        attempt="s1",
        world_size=2,
        files=prepared,
        metadata={"what": "forged"},
        coordinator=b.name,
    )
    resp = _peer_post(
        b, 1, "s1", "commit", {"manifest": forged.model_dump(mode="json"), "persist": False}
    )
    assert resp.status_code == 409 and resp.json()["code"] == "step_state", resp.text
    assert _latest(b) is None and _step_dirs(b, 1)  # B's sealed share is still there
    # The real decision commits B's share as sealed, with the job's metadata.
    manifest = StepManifest(
        namespace=NS,
        step=1,
        attempt="s1",
        world_size=2,
        files=prepared,
        metadata={"what": "test"},
        coordinator=a.name,
    )
    for d in (a, b):
        resp = _peer_post(
            d, 1, "s1", "commit", {"manifest": manifest.model_dump(mode="json"), "persist": False}
        )
        assert resp.status_code == 200, resp.text
    assert _read(b, 1) == ({"r00001.data": data}, {"what": "test"})
