"""The replication ring and the peer settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tierckpt_core.errors import PeerUnavailableError
from tierckpt_daemon.config import DaemonSettings
from tierckpt_daemon.membership import Membership, successors

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
