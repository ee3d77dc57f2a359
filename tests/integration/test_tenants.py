"""Tenants: a namespace belongs to the uid that saved it. Real daemons on real Unix sockets, and
clients forked under other uids (the test runs as root: root and the daemon's uid administer
everything, so a tenant is any other uid; the socket and the tier are reachable through group 0).

Each test is a boundary of docs/security.md, "Tenants and namespace ownership": one node (another
uid's calls are refused with ``namespace_owner``), across nodes (a peer's copy never replaces a
step this node committed, another uid's steps on a peer never become "latest" nor are read here).
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_client.dcp.sources.peers import Handoff
from tierckpt_core.errors import TierCkptError
from tierckpt_core.protocol import CommitRequest, SealFile

from helpers import DaemonProcess, ring, running, started, wait_until

TOKEN = "peer-token-for-the-tenant-tests-0123"
VICTIM, ATTACKER = 2001, 2002  # two tenants' uids (not root, not the daemon's)


def as_user(uid: int, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
    """``fn(*args)`` in a child forked as ``uid`` (group 0, no others): its result, or
    ``{"error": code}`` for a daemon error. Forked, not exec'ed: the interpreter lives where
    other uids cannot run it, and every module the call needs is loaded already."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(0)
            os.setuid(uid)
            try:
                out: Any = fn(*args)
            except TierCkptError as e:
                out = {"error": e.code, "detail": str(e)}
            os.write(w, json.dumps(out).encode())
        except BaseException as e:
            os.write(w, json.dumps({"crash": repr(e)}).encode())
            status = 1
        finally:
            os._exit(status)
    os.close(w)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"{fn.__name__} as uid {uid} did not finish in {timeout}s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    got = json.loads(data)
    assert not (isinstance(got, dict) and "crash" in got), got
    return got


# -- what a tenant's trainer does (run in the forked child) -------------------------------------


def save(sock: str, ns: str, step: int, payload: str) -> dict[str, Any]:
    """A save of one file holding ``payload``."""
    data = payload.encode()
    with DaemonClient.from_socket(sock) as c:
        lease = c.lease(ns, 0, len(data))
        with open(lease.path, "r+b") as f:
            f.write(data)
        attempt = uuid.uuid4().hex
        c.seal(
            ns, step, attempt, 0, [SealFile(lease_id=lease.lease_id, name="data", length=len(data))]
        )
        req = CommitRequest(files=["data"], metadata={"payload": payload}, world_size=1)
        return c.commit(ns, step, attempt, req).model_dump(mode="json")


def load_latest(sock: str, ns: str) -> dict[str, Any]:
    """What a reader of "latest" gets: the newest candidate, brought here, and its bytes."""
    with DaemonClient.from_socket(sock) as c:
        candidates = [x.step for x in c.candidates(ns)]
        info = c.hydrate(ns, candidates[0])
        pin = c.pin(ns, info.step)
        try:
            with open(pin.paths["data"], "rb") as f:
                payload = f.read(pin.step.files[0].length).decode()
        finally:
            c.unpin(ns, info.step, pin.pin_id)
        return {"candidates": candidates, "step": info.step, "payload": payload}


def call(sock: str, what: str, ns: str, step: int = 0) -> Any:
    """One API call by name, as a tenant's process would make it."""
    with DaemonClient.from_socket(sock) as c:
        if what == "namespaces":
            return [n.namespace for n in c.namespaces()]
        if what == "lease":
            return c.lease(ns, 0, 4096).lease_id
        if what == "latest":
            return c.latest(ns).step
        if what == "steps":
            return [s.step for s in c.steps(ns)]
        if what == "metadata":
            return c.metadata(ns, step)
        if what == "pin":
            return c.pin(ns, step).paths
        if what == "candidates":
            return [x.step for x in c.candidates(ns)]
        if what == "candidates+read":  # a load of "latest"
            return [x.step for x in c.candidates_read(ns).candidates]
        if what == "reads":  # a load's metadata request
            return c.open_read(ns, step, pin=False).version
        if what == "hydrate":
            return c.hydrate(ns, step).step
        if what == "delete":
            c.delete(ns, step)
            return "deleted"
        raise AssertionError(what)


def _refused(got: Any, code: str) -> dict[str, Any]:
    """``got`` is the daemon's refusal with ``code`` (not an answer)."""
    assert isinstance(got, dict) and got.get("error") == code, f"expected {code}, got {got!r}"
    return got


def handoff_range(sock: str, peer: str, ns: str, step: int, attempt: str) -> str:
    """The first 4 bytes of a peer's copy of ``ns/step``'s file, through the handoff socket."""
    handoff = Handoff(ClientConfig.from_env(socket=sock))
    with handoff.open(peer, ns, step, attempt, "data", 0, 4) as conn:
        data = b""
        while len(data) < 4 and (chunk := conn.recv(4 - len(data))):
            data += chunk
    return data.decode()


def _as_root(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _payload(d: DaemonProcess, ns: str, step: int) -> str:
    with DaemonClient.from_socket(d.socket) as c:
        return str(c.metadata(ns, step)["payload"])


def _step(d: DaemonProcess, ns: str, step: int) -> dict[str, Any] | None:
    with DaemonClient.from_socket(d.socket) as c:
        try:
            steps = c.steps(ns)
        except TierCkptError:
            return None
    got = next((s for s in steps if s.step == step), None)
    return got.model_dump(mode="json") if got is not None else None


def _settled(d: DaemonProcess, ns: str, step: int) -> bool:
    """``ns/step`` committed on ``d`` and its replication over (done, or given up)."""
    s = _step(d, ns, step)
    return s is not None and not s["replication_pending"]


# -- one node ------------------------------------------------------------------------------------


@pytest.fixture
def node() -> Iterator[DaemonProcess]:
    with started() as d:
        yield d


def test_a_namespace_belongs_to_the_uid_that_saved_it(node: DaemonProcess) -> None:
    sock = str(node.socket)
    as_user(VICTIM, save, sock, "teamB", 1, "victim-1")

    # Another uid reaches nothing of it: every call is a 403 with a code that names the cause.
    for what in (
        *("lease", "latest", "steps", "metadata", "pin", "candidates", "candidates+read"),
        *("reads", "hydrate", "delete"),
    ):
        got = _refused(as_user(ATTACKER, call, sock, what, "teamB", 1), "namespace_owner")
        assert "teamB" in got["detail"] and f"uid:{VICTIM}" in got["detail"], got
    _refused(as_user(ATTACKER, save, sock, "teamB", 2, "attacker"), "namespace_owner")
    assert "teamB" not in as_user(ATTACKER, call, sock, "namespaces", "")
    # It keeps its own namespaces, zero-config; each step says whose it is.
    assert as_user(ATTACKER, save, sock, "teamA", 1, "attacker-1")["owner"] == f"uid:{ATTACKER}"
    assert _step(node, "teamB", 1)["owner"] == f"uid:{VICTIM}"  # type: ignore[index]

    # The owner's trainer works as before; the operator (root) reaches every namespace.
    assert as_user(VICTIM, save, sock, "teamB", 2, "victim-2")["step"] == 2
    assert as_user(VICTIM, load_latest, sock, "teamB") == {
        "candidates": [2, 1],
        "step": 2,
        "payload": "victim-2",
    }
    assert _payload(node, "teamB", 1) == "victim-1"  # nothing the attacker did changed it
    assert _as_root(call, sock, "delete", "teamB", 1) == "deleted"
    assert sorted(_as_root(call, sock, "namespaces", "")) == ["teamA", "teamB"]


def replace_entries(sock: str, tier: str) -> dict[str, str]:
    """What a group member tries against the tier directory after a save of its own: each
    attempt's errno name, or "done". The attack it stands for (a review's): rename its step
    directory away, put a link to the tier in its place, and seal a socket of its own as the
    next file, so that the daemon moves it over daemon.sock."""
    save(sock, "evil", 1, "mine")
    root = tier
    ns_dir = os.path.join(root, "ns", "evil")
    step_dir = os.path.join(ns_dir, os.listdir(ns_dir)[0])
    with DaemonClient.from_socket(sock) as c:
        lease = c.lease("evil", 0, 4096)

    def attempt(fn: Callable[[], Any]) -> str:
        try:
            fn()
        except OSError as e:
            return errno.errorcode[e.errno or 0]
        return "done"

    def bind_over_socket() -> None:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(os.path.join(root, "mine.sock"))
        finally:
            s.close()

    return {
        "rename the step directory": attempt(lambda: os.rename(step_dir, step_dir + ".away")),
        "plant a link in the namespace": attempt(lambda: os.symlink(root, ns_dir + "/x")),
        "plant a record in the step": attempt(lambda: open(step_dir + "/MANIFEST.x", "x").close()),
        "remove the leased file": attempt(lambda: os.unlink(lease.path)),
        "plant a file in the pool": attempt(lambda: open(root + "/pool/x.bin", "x").close()),
        "remove daemon.sock": attempt(lambda: os.unlink(sock)),
        "bind a socket in the tier": attempt(bind_over_socket),
        "write the leased file": attempt(lambda: open(lease.path, "r+b").write(b"ok")),
    }


def test_a_group_member_writes_its_files_but_replaces_nothing_in_the_tier(
    node: DaemonProcess,
) -> None:
    got = as_user(ATTACKER, replace_entries, str(node.socket), str(node.shm_dir))
    assert got.pop("write the leased file") == "done", got  # what saves need
    assert got == dict.fromkeys(got, "EACCES"), got
    with DaemonClient.from_socket(node.socket) as c:  # the daemon and its socket are intact
        assert c.step("evil", 1).state.value == "committed"


def take_lease(sock: str, ns: str, payload: str) -> str:
    """A trainer's first save begins: a lease in a namespace no one owns here yet, filled."""
    data = payload.encode()
    with DaemonClient.from_socket(sock) as c:
        lease = c.lease(ns, 0, len(data))
        with open(lease.path, "r+b") as f:
            f.write(data)
        return lease.lease_id


def leases_in_tier(sock: str) -> list[str]:
    """The lease ids a member of the daemon's group reads off the tier directory."""
    with DaemonClient.from_socket(sock) as c:
        path = c.lease("scratch", 0, 4096).path  # its own lease shows where they live
    return [n.removesuffix(".bin") for n in os.listdir(os.path.dirname(path))]


def seal_lease(sock: str, ns: str, step: int, lease_id: str, length: int) -> dict[str, Any]:
    """Seal and commit one file from ``lease_id``."""
    with DaemonClient.from_socket(sock) as c:
        attempt = uuid.uuid4().hex
        c.seal(ns, step, attempt, 0, [SealFile(lease_id=lease_id, name="data", length=length)])
        req = CommitRequest(files=["data"], metadata={"payload": "sealed"}, world_size=1)
        return c.commit(ns, step, attempt, req).model_dump(mode="json")


def release_lease(sock: str, ns: str, lease_id: str) -> str:
    with DaemonClient.from_socket(sock) as c:
        c.release(ns, lease_id)
    return "released"


def test_a_lease_serves_only_the_uid_that_took_it(node: DaemonProcess) -> None:
    """Between a trainer's lease and its first seal, its namespace has no owner here yet: another
    uid, reading the lease ids off the tier directory, must not seal (claiming the namespace with
    the victim's bytes, and failing the victim's save) nor release the victim's leases."""
    sock = str(node.socket)
    mine = as_user(VICTIM, take_lease, sock, "teamB", "victim-1")
    other = as_user(VICTIM, take_lease, sock, "teamB", "victim-2")
    assert mine in as_user(ATTACKER, leases_in_tier, sock)

    _refused(as_user(ATTACKER, seal_lease, sock, "teamB", 1, mine, 8), "lease_not_found")
    _refused(as_user(ATTACKER, release_lease, sock, "teamB", other), "lease_not_found")
    assert _step(node, "teamB", 1) is None  # nothing claimed the namespace

    # The victim's save goes through with both of its leases.
    assert as_user(VICTIM, seal_lease, sock, "teamB", 1, mine, 8)["owner"] == f"uid:{VICTIM}"
    assert as_user(VICTIM, release_lease, sock, "teamB", other) == "released"


# -- several nodes ---------------------------------------------------------------------------------


def test_a_peers_copy_never_replaces_a_step_this_node_committed() -> None:
    """The same job (one uid) saves step 100 on both nodes: each keeps its own save; A's push
    of its step 100 to B, and a ``pull`` asked of B directly, are refused."""
    with running(ring(2, token=TOKEN)) as (a, b):
        as_user(VICTIM, save, str(b.socket), "job", 100, "from-b")
        wait_until("B's step 100 replicated to A", lambda: _step(a, "job", 100), 60)
        assert _step(a, "job", 100)["origin"] == b.name  # type: ignore[index]

        as_user(VICTIM, save, str(a.socket), "job", 100, "from-a")  # replaces A's replica
        wait_until("A's push of its step 100 settled", lambda: _settled(a, "job", 100), 60)
        mine = _step(b, "job", 100)
        assert mine is not None and mine["origin"] is None, mine
        assert _payload(b, "job", 100) == "from-b"
        assert _step(a, "job", 100)["replicated_to"] == []  # type: ignore[index]

        resp = httpx.post(
            f"http://{b.name}/v1/peer/namespaces/job/steps/100/pull",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"origin": a.name},
            timeout=30,
        )
        assert resp.status_code == 403 and resp.json()["code"] == "namespace_owner", resp.text
        assert _payload(b, "job", 100) == "from-b"
        assert as_user(VICTIM, load_latest, str(b.socket), "job")["payload"] == "from-b"


def test_another_uids_steps_on_a_peer_never_become_latest() -> None:
    """The issue's attack: a trainer on node A (another uid) saves the namespace of a job that
    runs on node B, the same step and a far newer one; A pushes them to B."""
    nodes = ring(2, token=TOKEN)
    nodes[1].settings["replicas"] = 0  # B keeps its steps to itself: A knows nothing of teamB
    with running(nodes) as (a, b):
        as_user(VICTIM, save, str(b.socket), "teamB", 100, "victim-100")
        as_user(ATTACKER, save, str(a.socket), "teamB", 100, "planted-100")
        as_user(ATTACKER, save, str(a.socket), "teamB", 999999, "planted-999999")
        for step in (100, 999999):
            wait_until(f"A's push of step {step} settled", lambda s=step: _settled(a, "teamB", s))

        assert _step(b, "teamB", 999999) is None
        assert _payload(b, "teamB", 100) == "victim-100"
        got = as_user(VICTIM, load_latest, str(b.socket), "teamB")
        assert got == {"candidates": [100], "step": 100, "payload": "victim-100"}, got
        # Asked for by number, A's step is not this tenant's either.
        _refused(as_user(VICTIM, call, str(b.socket), "hydrate", "teamB", 999999), "step_not_found")


def test_a_peers_steps_are_read_only_by_their_own_uid() -> None:
    """A node that lost its memory restores a tenant's step from the peer's replica, for that
    tenant only: another uid on the node neither sees it nor gets it."""
    with running(ring(2, token=TOKEN)) as (a, b):
        as_user(VICTIM, save, str(b.socket), "teamB", 7, "victim-7")
        wait_until("B's step 7 replicated to A", lambda: _step(a, "teamB", 7), 60)
        b.lose_node()
        b.start()

        # A's copy, asked for straight through B's handoff socket (as a restore from a peer
        # does), by its attempt id: served to its owner only.
        listing = httpx.get(
            f"http://{a.name}/v1/peer/namespaces/teamB/steps",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        ).json()
        attempt = next(s["attempt"] for s in listing if s["step"] == 7)
        ask = (str(b.socket), a.name, "teamB", 7, attempt)
        _refused(as_user(ATTACKER, handoff_range, *ask), "step_not_found")
        assert as_user(VICTIM, handoff_range, *ask) == "vict"

        _refused(
            as_user(ATTACKER, call, str(b.socket), "candidates", "teamB"), "namespace_not_found"
        )
        _refused(as_user(ATTACKER, call, str(b.socket), "hydrate", "teamB", 7), "step_not_found")
        got = as_user(VICTIM, load_latest, str(b.socket), "teamB")
        assert got == {"candidates": [7], "step": 7, "payload": "victim-7"}, got


def test_a_replica_does_not_claim_a_namespace_on_its_receiver() -> None:
    """A namespace's owner on a node is claimed by that node's own trainers only: replicas of
    another uid's ``teamB`` pushed to B (which never held teamB) must not lock the victim's job
    out of its namespace when it moves to B, become its "latest", nor (far newer, as many as
    retention keeps) make retention drop the victim's own save there."""
    with running(ring(2, token=TOKEN)) as (a, b):
        planted = (999998, 999999)  # TIERCKPT_KEEP_LAST is 2
        for step in planted:
            as_user(ATTACKER, save, str(a.socket), "teamB", step, f"planted-{step}")
            wait_until(f"A's step {step} replicated to B", lambda s=step: _step(b, "teamB", s))
        bsock = str(b.socket)

        # Before its first save on B, the victim sees none of the attacker's copies.
        _refused(as_user(VICTIM, call, bsock, "latest", "teamB"), "namespace_not_found")
        _refused(as_user(VICTIM, call, bsock, "candidates", "teamB"), "namespace_not_found")
        _refused(as_user(VICTIM, call, bsock, "metadata", "teamB", planted[1]), "step_not_found")
        _refused(as_user(VICTIM, call, bsock, "pin", "teamB", planted[1]), "step_not_found")

        saved = as_user(VICTIM, save, bsock, "teamB", 3, "victim-3")
        assert saved["owner"] == f"uid:{VICTIM}", saved
        assert as_user(VICTIM, call, bsock, "latest", "teamB") == 3
        assert as_user(VICTIM, call, bsock, "steps", "teamB") == [3]
        got = as_user(VICTIM, load_latest, bsock, "teamB")
        assert got == {"candidates": [3], "step": 3, "payload": "victim-3"}, got
        # The namespace is the victim's on B now: the attacker is refused there, and the
        # operator's view of it (its owner's) shows none of the attacker's copies.
        _refused(as_user(ATTACKER, call, bsock, "latest", "teamB"), "namespace_owner")
        assert _step(b, "teamB", planted[1]) is None
