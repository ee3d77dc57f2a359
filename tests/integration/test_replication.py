"""Replication between daemons: pushes to the ring successor, restore from a peer after a node loss,
the peer token, a peer that is down, a corrupt replica, and the settings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.protocol import StepInfo

from helpers import DaemonProcess, run_ranks, wait_until
from kit import blank_state, cli, load, save, seeded_state

TOKEN = "peer-token-for-the-tests-0123456789"
N = 1 << 15


def _name(d: DaemonProcess) -> str:
    return f"127.0.0.1:{d.settings['port']}"


@pytest.fixture
def ring(make_ring: Callable[..., list[DaemonProcess]]) -> list[DaemonProcess]:
    return make_ring(2, token=TOKEN)


def _steps(d: DaemonProcess, ns: str) -> dict[int, StepInfo]:
    with DaemonClient.from_socket(d.socket) as c:
        return {s.step: s for s in c.steps(ns)}


def _replicated(d: DaemonProcess, ns: str, step: int, peer: DaemonProcess) -> bool:
    info = _steps(d, ns).get(step)
    return info is not None and info.replicated_to == [_name(peer)] and not info.replication_pending


def _reboot(d: DaemonProcess) -> None:
    """A replacement node: the daemon's memory tier is gone."""
    d.kill()
    shutil.rmtree(d.shm_dir)
    d.start()


# -- two ranks through one node's daemon; the node dies; its replacement restores from the peer ----


def _full(step: int) -> torch.Tensor:
    return torch.randn(64, 16, generator=torch.Generator().manual_seed(step))


def _save_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    mesh = init_device_mesh("cpu", (world,))
    for step in (10, 20):
        sd = {"w": distribute_tensor(_full(step), mesh, [Shard(0)]), "extra": {"step": step}}
        dcp.save(sd, storage_writer=TieredStorageWriter("job", step))


def _load_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    mesh = init_device_mesh("cpu", (world,))
    dest = {"w": distribute_tensor(torch.zeros(64, 16), mesh, [Shard(1)]), "extra": {"step": -1}}
    reader = TieredStorageReader("job", process_group=dist.group.WORLD)
    dcp.load(dest, storage_reader=reader)
    # Read straight from B; the daemon brings the step into its memory after the load.
    assert reader.memory_fill is not None
    reader.memory_fill.join(60)
    assert reader.resolved_step == 20
    assert torch.equal(dest["w"].full_tensor(), _full(20))  # bit-exact
    assert dest["extra"] == {"step": 20}


@pytest.mark.slow
def test_a_replacement_node_restores_the_latest_step_from_its_peer(
    ring: list[DaemonProcess],
) -> None:
    a, b = ring
    run_ranks(_save_worker, 2, str(a.socket))

    # A pushed both committed steps to its ring successor B; each side says so.
    wait_until(
        "steps 10 and 20 replicated to B",
        lambda: all(_replicated(a, "job", s, b) for s in (10, 20)),
        30,
    )
    on_b = _steps(b, "job")
    assert {s: (i.origin, i.state.value) for s, i in on_b.items()} == {
        10: (_name(a), "committed"),
        20: (_name(a), "committed"),
    }
    on_a = _steps(a, "job")
    assert {f.name for f in on_b[20].files} == {f.name for f in on_a[20].files}
    assert on_b[20].committed_at == on_a[20].committed_at  # a replica is no new save
    with DaemonClient.from_socket(a.socket) as c:
        rep = c.status().replication
    assert rep is not None and rep.node == _name(a) and rep.replicas == 1
    assert rep.peers == sorted([_name(a), _name(b)]) and rep.last_error is None
    assert rep.replicated_steps == 2 and rep.replicated_bytes > 2 * 64 * 16 * 4
    with DaemonClient.from_socket(b.socket) as c:
        rep_b = c.status().replication
    assert rep_b is not None and rep_b.received_steps == 2
    ls = cli("ls", "job", node=a)
    assert ls.returncode == 0, ls.stderr
    row = next(line.split() for line in ls.stdout.splitlines() if line.startswith("20 "))
    assert row[-2:] == ["memory,peers", _name(b)]
    status = cli("status", node=a).stdout
    assert f"replication as {_name(a)} to 1 of peers {_name(b)}" in status

    # The node dies and comes back empty: no persistent tier, yet "latest" finds step 20 on B.
    _reboot(a)
    with DaemonClient.from_socket(a.socket) as c:
        cands = [(x.step, x.in_memory, x.durable, x.peers) for x in c.candidates("job")]
    assert cands == [(20, False, False, [_name(b)]), (10, False, False, [_name(b)])]
    run_ranks(_load_worker, 2, str(a.socket))
    restored = _steps(a, "job")
    assert sorted(restored) == [20]  # only what the restore needed came back
    assert restored[20].replicated_to == [_name(b)]  # B holds the same bytes: nothing is re-sent
    assert (restored[20].created_at, restored[20].committed_at) == (
        on_a[20].created_at,
        on_a[20].committed_at,
    )
    metrics = httpx.get(f"http://127.0.0.1:{a.settings['port']}/metrics", timeout=10).text
    hydrated = next(
        line
        for line in metrics.splitlines()
        if line.startswith("tierckpt_peer_hydrated_bytes_total")
    )
    assert float(hydrated.split()[-1]) > 64 * 16 * 4


# -- the peer API's token and where routes are served ---------------------------------------------


def test_peer_routes_refuse_a_missing_or_wrong_token(ring: list[DaemonProcess]) -> None:
    a, _ = ring
    base = f"http://127.0.0.1:{a.settings['port']}"
    url = f"{base}/v1/peer/namespaces/job/steps"

    r = httpx.get(url, timeout=10)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["code"] == "unauthorized" and "missing peer token" in r.json()["detail"]
    wrong = "wrong-token-but-long-enough-0123"
    r = httpx.get(url, headers={"Authorization": f"Bearer {wrong}"}, timeout=10)
    assert r.status_code == 401 and "wrong peer token" in r.json()["detail"]
    assert wrong not in r.text and TOKEN not in r.text
    r = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200 and r.json() == []

    # The token opens the peer routes only: local routes stay on the Unix socket.
    r = httpx.get(f"{base}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 403 and "only served on the daemon's Unix socket" in r.json()["detail"]
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(a.socket))) as local:
        r = local.get("http://tierckpt/v1/peer/namespaces/job/steps")
    assert r.status_code == 403 and "TCP port only" in r.json()["detail"]


def test_a_peer_with_another_token_cannot_push(
    make_ring: Callable[..., list[DaemonProcess]],
) -> None:
    a, b = make_ring(2, token=TOKEN, start=False)
    b.settings["peer_token"] = "a-different-token-0123456789"
    a.start()
    b.start()
    save("job", 1, seeded_state(1, N), node=a)
    with DaemonClient.from_socket(a.socket) as c:
        rep = wait_until(
            "a failed push",
            lambda: (s := c.status().replication) and s.last_error and s,
            30,
        )
    assert "wrong peer token" in rep.last_error and _name(b) in rep.last_error
    assert _steps(a, "job")[1].replication_pending  # held in memory until it is replicated
    with DaemonClient.from_socket(b.socket) as c:
        assert c.namespaces() == []


# -- a peer that is down ---------------------------------------------------------------------------


def test_a_save_succeeds_while_the_peer_is_down_and_replicates_when_it_is_back(
    make_ring: Callable[..., list[DaemonProcess]],
) -> None:
    a, b = make_ring(2, token=TOKEN, start=False)
    a.start()
    save("job", 1, seeded_state(1, N), node=a)  # B is not running: the save must not notice
    with DaemonClient.from_socket(a.socket) as c:
        rep = wait_until(
            "the push to B to fail",
            lambda: (s := c.status().replication) and s.failed_pushes and s,
            30,
        )
    assert rep.unreachable == [_name(b)]
    assert rep.last_error is not None and "replicated to 0 of 1 peers" in rep.last_error
    assert _name(b) in rep.last_error
    info = _steps(a, "job")[1]
    assert info.replication_pending and info.replicated_to == []
    step, out = load("job", blank_state(N), node=a)  # the memory tier keeps serving meanwhile
    assert step == 1 and torch.equal(out["w"], seeded_state(1, N)["w"])

    b.start()
    wait_until("step 1 replicated once B is back", lambda: _replicated(a, "job", 1, b), 30)
    with DaemonClient.from_socket(a.socket) as c:
        rep = c.status().replication
    assert rep is not None and rep.unreachable == [] and rep.last_error is None
    assert _steps(b, "job")[1].origin == _name(a)
    # One warning for the outage, not one per retry.
    assert a.log().count(f"WARNING tierckpt_daemon.peers.membership: peer {_name(b)}") == 1


# -- a corrupt replica -----------------------------------------------------------------------------


def test_a_corrupt_replica_is_skipped_for_the_persistent_tier(
    tmp_path: Path, make_ring: Callable[..., list[DaemonProcess]]
) -> None:
    a, b = make_ring(2, token=TOKEN, per_node=[{"persist_url": f"file://{tmp_path / 'store'}"}, {}])
    save("job", 10, seeded_state(10, N), node=a)
    wait_until(
        "step 10 replicated and durable",
        lambda: _replicated(a, "job", 10, b) and _steps(a, "job")[10].state.value == "durable",
        30,
    )
    (data,) = (b.shm_dir / "ns" / "job").glob("*/r00000.data")
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))

    _reboot(a)
    step, out = load("job", blank_state(N), node=a)
    assert step == 10 and torch.equal(out["w"], seeded_state(10, N)["w"])
    log = a.log()
    assert f"the replica on peer {_name(b)} is unusable" in log
    assert "file r00000.data in peer" in log and "is corrupt" in log
    assert "trying the persistent tier" in log
    assert _steps(a, "job")[10].state.value == "durable"


# -- settings --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"TIERCKPT_PEERS": "127.0.0.1:8474"},
            "TIERCKPT_PEER_TOKEN (or TIERCKPT_PEER_TOKEN_FILE) is required",
        ),
        (
            {"TIERCKPT_PEERS": "127.0.0.1:8474,node-b", "TIERCKPT_PEER_TOKEN": TOKEN},
            "peer 'node-b': use host:port",
        ),
    ],
)
def test_bad_peer_settings_stop_the_daemon_with_exit_2(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCKPT_")}
    full_env.update(env, TIERCKPT_SHM_DIR=str(tmp_path / "tier"), TIERCKPT_PORT="8474")
    proc = subprocess.run(
        [sys.executable, "-m", "tierckpt_daemon"],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and TOKEN not in proc.stderr


def test_a_damaged_memory_copy_with_a_replica_is_dropped_and_read_from_the_peer(
    ring: list[DaemonProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step replicated to a peer whose copy in this node's memory is damaged: the first
    restore falls back past it, the daemon confirms the damage and drops its copy, and the next
    restore reads the step from the peer's replica (every restore fell back before)."""
    a, b = ring
    monkeypatch.setenv("TIERCKPT_SOCKET", str(a.socket))
    for step in (1, 2):
        save("rep", step, seeded_state(step, N), staged=False)
    wait_until("step 2 replicated to B", lambda: _replicated(a, "rep", 2, b))
    with DaemonClient.from_socket(a.socket) as c:
        pin = c.pin("rep", 2)
        c.unpin("rep", 2, pin.pin_id)
    path = max(pin.paths.values(), key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    step, out = load("rep", blank_state(N))
    assert step == 1 and torch.equal(out["w"], seeded_state(1, N)["w"])
    wait_until("A's copy of step 2 dropped", lambda: 2 not in _steps(a, "rep"))
    step, out = load("rep", blank_state(N))
    assert step == 2 and torch.equal(out["w"], seeded_state(2, N)["w"])
