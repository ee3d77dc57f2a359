"""``tierckpt ls --cluster``: the daemon asks its peers what they hold, and lists each node's steps
(committed or durable, replicas and where they came from); a peer that is down or does not answer
in time is shown as unreachable and never hangs the command."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt_client.dcp import TieredStorageWriter

from helpers import DaemonProcess, ring, wait_until
from kit import cli

TOKEN = "peer-token-for-the-cluster-listing-01"


def _listing(d: DaemonProcess, *args: str) -> dict[str, Any]:
    proc = cli("ls", "--cluster", "--json", *args, node=d)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[DaemonProcess]]:
    a, b = ring(2, token=TOKEN, capacity="64M")
    a.settings["persist_url"] = (tmp_path / "tier").as_uri()
    try:
        a.start()
        b.start()
        yield [a, b]
    finally:
        for d in (a, b):
            if d.proc is not None and d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)
            d.cleanup()


def _save_on(d: DaemonProcess, step: int, persist: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_SOCKET", str(d.socket))
    sd = {"w": torch.arange(1 << 14, dtype=torch.float32) + step}
    writer = TieredStorageWriter("job", step, persist=persist)
    dcp.async_save(sd, storage_writer=writer, no_dist=True).result()


@pytest.mark.slow
def test_ls_cluster_lists_each_nodes_steps_and_an_unreachable_peer(
    nodes: list[DaemonProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = nodes
    _save_on(a, 1, False, monkeypatch)
    _save_on(a, 2, True, monkeypatch)

    def settled() -> bool:
        st = a.status()
        return bool(
            st
            and st["replication"]["replicated_steps"] == 2
            and st["persistent"]["uploaded_steps"] == 1
        )

    wait_until("both steps replicated to B and step 2 durable", settled)

    doc = _listing(a)
    assert doc["node"] == a.name
    by_node = {n["node"]: n for n in doc["nodes"]}
    assert set(by_node) == {a.name, b.name}
    assert all(n["reachable"] and n["error"] is None for n in by_node.values())
    on_a = {s["step"]: s for s in by_node[a.name]["steps"]}
    on_b = {s["step"]: s for s in by_node[b.name]["steps"]}
    assert {k: (v["state"], v["replicated_to"], v["origin"]) for k, v in on_a.items()} == {
        1: ("committed", [b.name], None),
        2: ("durable", [b.name], None),
    }
    assert {k: (v["namespace"], v["origin"]) for k, v in on_b.items()} == {
        1: ("job", a.name),
        2: ("job", a.name),
    }
    assert on_a[2]["bytes"] == on_b[2]["bytes"] >= (1 << 16)

    # Asked the other way round, B sees the same.
    assert {n["node"] for n in _listing(b)["nodes"] if n["reachable"]} == {a.name, b.name}

    # The table: one line per node and step, replicas said in words.
    table = cli("ls", "--cluster", node=a).stdout.splitlines()
    assert table[0].split() == [
        "NODE",
        "NAMESPACE",
        "STEP",
        "STATE",
        "SIZE",
        "FILES",
        "AGE",
        "REPLICAS",
    ]
    assert any(
        line.split()[:4] == [b.name, "job", "2", "committed"] and f"replica of {a.name}" in line
        for line in table
    ), table
    assert any(line.split()[:4] == [a.name, "job", "2", "durable"] for line in table), table

    # A namespace filter; a namespace nobody holds lists every node with no steps.
    assert all(n["steps"] == [] for n in _listing(a, "other")["nodes"])
    assert "no steps" in cli("ls", "--cluster", "other", node=a).stdout

    # The peer route behind it needs the token.
    resp = httpx.get(f"http://{b.name}/v1/peer/inventory", timeout=10)
    assert resp.status_code == 401

    # A peer that accepts connections but does not answer (stopped): unreachable after --timeout.
    assert b.proc is not None
    plain = cli("ls", "job", node=a)
    assert plain.returncode == 0 and "did not answer" not in plain.stderr, plain.stderr
    b.proc.send_signal(signal.SIGSTOP)
    try:
        hung = {n["node"]: n for n in _listing(a, "--timeout", "1")["nodes"]}
        # A plain listing of the namespace says that it may lack the hung peer's copies.
        plain = cli("ls", "job", node=a)
    finally:
        b.proc.send_signal(signal.SIGCONT)
    assert plain.returncode == 0, plain.stderr
    assert f"peers did not answer, their copies are not listed: {b.name} (" in plain.stderr
    assert [line.split()[0] for line in plain.stdout.splitlines()[1:]] == ["1", "2"]
    st = a.status()
    assert st is not None and st["replication"]["unreachable"] == [b.name]
    # B answers again: the next call that reaches it clears the mark (it stayed for good where
    # no push went to B: a status naming a healthy peer UNREACHABLE, or blaming the wrong one).
    assert {n["node"] for n in _listing(a)["nodes"] if n["reachable"]} == {a.name, b.name}
    st = a.status()
    assert st is not None and st["replication"]["unreachable"] == [], st["replication"]
    assert not hung[b.name]["reachable"] and hung[b.name]["steps"] == []
    assert "in time" in hung[b.name]["error"] or "within 1s" in hung[b.name]["error"]
    assert sorted(s["step"] for s in hung[a.name]["steps"]) == [1, 2]

    # A peer that is down (its node is gone): unreachable, with the reason; this node's steps are
    # still listed.
    b.kill()
    down = cli("ls", "--cluster", node=a)
    assert down.returncode == 0, down.stderr
    assert f"{b.name} is unreachable: peer {b.name}" in down.stdout
    assert any(
        line.split()[:4] == [b.name, "-", "-", "UNREACHABLE"] for line in down.stdout.splitlines()
    ), down.stdout
    assert any(line.split()[:3] == [a.name, "job", "1"] for line in down.stdout.splitlines())


def test_ls_cluster_without_peers_lists_this_node_and_says_so(client_env: DaemonProcess) -> None:
    sd = {"w": torch.ones(1024)}
    dcp.save(sd, storage_writer=TieredStorageWriter("solo", 3), no_dist=True)
    doc = _listing(client_env)
    assert doc["node"] is None
    [only] = doc["nodes"]
    assert only["reachable"] and [(s["namespace"], s["step"]) for s in only["steps"]] == [
        ("solo", 3)
    ]
    assert "has no peers" in cli("ls", "--cluster", node=client_env).stdout
    bad = cli("ls", "--cluster", "--timeout", "0", node=client_env)
    assert bad.returncode == 2 and "--timeout" in bad.stderr
