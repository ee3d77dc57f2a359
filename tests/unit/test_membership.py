"""The replication ring and the peer settings."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from tierckpt_core.errors import NotAMemberError, PeerUnavailableError
from tierckpt_core.launcher import free_port
from tierckpt_core.manifest import StepManifest
from tierckpt_core.protocol import DecideRequest, PrepareRequest
from tierckpt_daemon.config import DaemonSettings
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import Members, Membership, successors

TOKEN = "s3cret-token-0123456789"


def test_every_node_gets_the_next_k_members_and_never_itself() -> None:
    ring = ["10.0.0.3:8474", "10.0.0.1:8474", "10.0.0.2:8474", "10.0.0.4:8474"]
    assert successors(ring, "10.0.0.1:8474") == ["10.0.0.2:8474", "10.0.0.3:8474", "10.0.0.4:8474"]
    assert successors(ring, "10.0.0.4:8474") == ["10.0.0.1:8474", "10.0.0.2:8474", "10.0.0.3:8474"]
    # With k=1 every node's replica lands on a different node: the ring has no hot spot.
    firsts = {node: successors(ring, node)[0] for node in ring}
    assert sorted(firsts.values()) == sorted(ring)
    # The order does not depend on how each node's list happens to be written.
    assert successors(list(reversed(ring)), "10.0.0.2:8474") == successors(ring, "10.0.0.2:8474")


def test_a_node_missing_from_dns_still_finds_its_place() -> None:
    # A pod whose address DNS does not list yet replicates to the member after its own position.
    assert successors(["a:1", "c:1"], "b:1") == ["c:1", "a:1"]
    assert successors(["a:1"], "a:1") == []


def test_peer_lists_are_parsed_and_normalized() -> None:
    m = Membership.parse(" 10.0.0.2:8474, node-a.example:9000 ,[fd00::1]:8474,10.0.0.2:8474")
    assert m.members() == ["10.0.0.2:8474", "[fd00::1]:8474", "node-a.example:9000"]
    dns = Membership.parse("dns:localhost:8474")
    assert dns.dns == ("localhost", 8474)
    assert "127.0.0.1:8474" in dns.members()  # resolved now, with getaddrinfo
    with pytest.raises(PeerUnavailableError, match="cannot resolve the peers' DNS name"):
        Membership.parse("dns:no-such-host.invalid:8474").members()


@pytest.mark.parametrize(
    ("peers", "message"),
    [
        ("10.0.0.1", "use host:port"),
        ("10.0.0.1:http", "port 'http' is not a number"),
        ("10.0.0.1:70000", "port '70000' is not a number in 1..65535"),
        ("fd00::1:8474", "use host:port"),
        ("[nope]:8474", "is not an IPv6 address"),
        ("dns:svc", "use host:port"),
        (" , ", "TIERCKPT_PEERS is empty"),
    ],
)
def test_bad_peer_entries_are_settings_errors(peers: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DaemonSettings(peers=peers, peer_token=TOKEN)


def test_peers_need_a_token_and_a_place_on_the_ring(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"TIERCKPT_PEER_TOKEN .* is required"):
        DaemonSettings(peers="127.0.0.1:8474,127.0.0.1:8475")
    with pytest.raises(ValidationError, match="at least 16 characters") as err:
        DaemonSettings(peers="127.0.0.1:8474", peer_token="hunter2")
    assert "hunter2" not in err.value.errors()[0]["msg"]  # what the daemon prints never echoes it
    with pytest.raises(
        ValidationError, match=r"TIERCKPT_NODE_NAME 127\.0\.0\.1:8474 is not one of"
    ):
        DaemonSettings(peers="10.0.0.1:8474,10.0.0.2:8474", peer_token=TOKEN)
    with pytest.raises(ValidationError, match="set TIERCKPT_NODE_NAME"):
        DaemonSettings(peers="dns:svc:8474", peer_token=TOKEN, host="0.0.0.0")
    with pytest.raises(ValidationError, match="needs the TCP port"):
        DaemonSettings(peers="127.0.0.1:8474", peer_token=TOKEN, port=0)

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    s = DaemonSettings(
        peers="dns:svc:8474", peer_token_file=token_file, host="0.0.0.0", node_name="10.1.2.3:8474"
    )
    assert s.peer_secret is not None and s.peer_secret.get_secret_value() == TOKEN
    assert s.node_name == "10.1.2.3:8474" and s.replicas == 1
    assert TOKEN not in repr(s)
    with pytest.raises(ValidationError, match="not both"):
        DaemonSettings(peer_token=TOKEN, peer_token_file=token_file)
    with pytest.raises(ValidationError, match=r"TIERCKPT_PEER_TOKEN_FILE .*missing"):
        DaemonSettings(peer_token_file=tmp_path / "missing")
    assert DaemonSettings().peers is None  # replication is off by default


def test_members_are_the_listed_addresses_exactly() -> None:
    static = Members(Membership.parse("10.0.0.1:8474,10.0.0.2:8474"), "10.0.0.1:8474")
    assert static.is_member("10.0.0.2:8474")
    for other in ("10.0.0.3:8474", "10.0.0.2:8475", "10.0.0.2:8474/x", ""):
        assert not static.is_member(other)
    # DNS: what the name resolves to now, and this node even when DNS does not list it yet.
    dns = Members(Membership.parse("dns:localhost:8474"), "10.9.9.9:8474")
    assert dns.is_member("127.0.0.1:8474") and dns.is_member("10.9.9.9:8474")
    assert not dns.is_member("127.0.0.1:8475")
    with pytest.raises(NotAMemberError, match=r"'127\.0\.0\.1:8475' is not a member of the ring"):
        dns.require("127.0.0.1:8475", "a test")


def test_the_peer_client_sends_nothing_to_an_address_outside_the_ring(tmp_path: Path) -> None:
    """Whatever a call site passes it, the client that attaches the token dials members only."""
    member = f"127.0.0.1:{free_port()}"
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 10)
    manifest = StepManifest(
        namespace="job",
        step=1,
        attempt="a1",
        world_size=1,
        files=[],
        metadata={},
        coordinator=member,
    )
    decision = DecideRequest(manifest=manifest, persist=False)
    prepare = PrepareRequest(coordinator=member, participants=[member], files=["x"], world_size=1)
    ear = socket.socket()
    ear.bind(("127.0.0.1", 0))
    ear.listen(16)  # connections would queue here, accepted or not
    ear.setblocking(False)
    stranger = f"127.0.0.1:{ear.getsockname()[1]}"
    client = PeerClient(TOKEN, members=Members(Membership.parse(member), member), timeout_s=2)
    calls: list[Callable[[], object]] = [
        lambda: client.list_steps(stranger, "job"),
        lambda: client.inventory(stranger),
        lambda: client.manifest(stranger, "job", 1),
        lambda: client.get_file(stranger, "job", 1, "a1", "x", str(path), 10),
        lambda: client.get_file_blocks(stranger, "job", 1, "a1", "x", str(path), 10, 10, ["c"]),
        lambda: client.open_range(stranger, "job", 1, "a1", "x", 0, 10),
        lambda: client.read_range(stranger, "job", 1, "a1", "x", 0, 10),
        lambda: client.prepare(stranger, "job", 1, "a1", prepare),
        lambda: client.decide(stranger, decision),
        lambda: client.abort(stranger, "job", 1, "a1"),
        lambda: client.outcome(stranger, "job", 1, "a1"),
        lambda: client.pull(stranger, "job", 1, member, 10),
    ]
    try:
        for call in calls:
            with pytest.raises(NotAMemberError, match="not a member of the ring"):
                call()
        with pytest.raises(BlockingIOError):  # no connection was ever made
            ear.accept()
    finally:
        client.close()
        ear.close()
