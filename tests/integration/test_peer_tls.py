"""TLS on the peer port: two real daemons replicate and restore a step over HTTPS with certificates
made here (a throwaway CA); a peer whose certificate another CA issued is refused and the status
says why; half-given or unreadable TLS settings stop the daemon with a message that names them.
(Plain-HTTP peers, TLS off, are what tests/integration/test_replication.py runs.)"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from tierckpt_client import DaemonClient
from tierckpt_core.protocol import StepInfo

from certs import CA, tls_settings
from helpers import DaemonProcess, wait_until
from kit import blank_state, reader, save, seeded_state

TOKEN = "peer-token-for-the-tls-tests-0123456789"
N = 1 << 14
SERVER_NAME = "tierckpt-peer.tierckpt.svc"


# -- daemons and steps --------------------------------------------------------------------------------


def _steps(d: DaemonProcess, ns: str) -> dict[int, StepInfo]:
    with DaemonClient.from_socket(d.socket) as c:
        return {s.step: s for s in c.steps(ns)}


# -- over TLS ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("naming", ["address", "server_name"])
def test_two_daemons_replicate_and_restore_a_step_overtls_settings(
    tmp_path: Path,
    naming: str,
    caplog: pytest.LogCaptureFixture,
    make_ring: Callable[..., list[DaemonProcess]],
) -> None:
    ca = CA.make(tmp_path, "cluster-ca")
    if naming == "address":  # each certificate carries the address its peers dial (an IP here)
        certs = [ca.issue(tmp_path, f"node{i}", dns=[], ips=["127.0.0.1"]) for i in (0, 1)]
        extra: dict[str, str] = {}
    else:  # one name for every daemon, whatever address a peer dials
        certs = [ca.issue(tmp_path, f"node{i}", dns=[SERVER_NAME], ips=[]) for i in (0, 1)]
        extra = {"peer_tls_server_name": SERVER_NAME}
    a, b = make_ring(2, token=TOKEN, per_node=[tls_settings(ca, c, **extra) for c in certs])
    save("job", 7, seeded_state(7, N, tag="tls"), node=a, staged=False)
    wait_until(
        "step 7 replicated to B over TLS",
        lambda: (s := _steps(a, "job").get(7)) and s.replicated_to == [b.name] and s,
    )
    on_b = _steps(b, "job")
    assert on_b[7].origin == a.name and on_b[7].state.value == "committed"
    with DaemonClient.from_socket(a.socket) as c:
        rep = c.status().replication
    assert rep is not None and rep.last_error is None and rep.replicated_steps == 1

    # The TCP port speaks TLS only: a client that trusts the CA gets the probes and the peer
    # routes (with the token); plain HTTP gets no answer from it.
    port = a.settings["port"]
    verify = ssl.create_default_context(cafile=str(ca.path))
    verify.check_hostname = False  # the "server_name" certificates do not name 127.0.0.1
    with httpx.Client(verify=verify, timeout=10) as https:
        assert https.get(f"https://127.0.0.1:{port}/healthz").json() == {"status": "ok"}
        r = https.get(
            f"https://127.0.0.1:{port}/v1/peer/namespaces/job/steps",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert r.status_code == 200 and [s["step"] for s in r.json()] == [7]
        r = https.get(f"https://127.0.0.1:{port}/v1/peer/namespaces/job/steps")
        assert r.status_code == 401  # TLS does not replace the token
    # (Raw sockets, closed here: a failed handshake inside httpx's one-shot calls left its
    # socket to the garbage collector, whose ResourceWarning then failed a later test.)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        try:
            answer = plain.recv(4096)
        except OSError:  # reset by the TLS server
            answer = b""
    assert not answer.startswith(b"HTTP/")
    # A client that does not trust the cluster's CA is not talked into it.
    untrusting = ssl.create_default_context()
    refused = pytest.raises(ssl.SSLCertVerificationError, match="CERTIFICATE_VERIFY_FAILED")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, refused:
        untrusting.wrap_socket(raw, server_hostname="127.0.0.1")

    # A's node is lost; its replacement restores step 7 from B, over TLS, bit-exact: the
    # trainer reads it through A, which relays what it receives from B (a TLS session cannot
    # be handed over), and A brings the step into its memory after.
    a.kill()
    shutil.rmtree(a.shm_dir)
    a.start()
    with caplog.at_level(logging.INFO, logger="tierckpt_client"):
        r = reader("job", out := blank_state(N, tag="tls"), node=a)
        if r.memory_fill is not None:  # read from the peer: the daemon fills its memory after
            r.memory_fill.join(60)
        step = r.resolved_step
    assert step == 7
    want = seeded_state(7, N, tag="tls")
    assert torch.equal(out["w"], want["w"])  # type: ignore[arg-type]
    assert out["meta"] == want["meta"]
    assert "reading it straight from the peers that hold it" in caplog.text
    assert "reading it from the peers failed" not in caplog.text
    assert [s.step for s in _steps(a, "job").values()] == [7]


@pytest.mark.slow
def test_a_peer_with_a_certificate_from_another_ca_is_refused(
    tmp_path: Path, make_ring: Callable[..., list[DaemonProcess]]
) -> None:
    ca, stranger_ca = CA.make(tmp_path, "cluster-ca"), CA.make(tmp_path, "stranger-ca")
    good = ca.issue(tmp_path, "node0", dns=[], ips=["127.0.0.1"])
    # B trusts the cluster's CA but presents a certificate another CA issued.
    stranger = stranger_ca.issue(tmp_path, "node1", dns=[], ips=["127.0.0.1"])
    a, b = make_ring(2, token=TOKEN, per_node=[tls_settings(ca, good), tls_settings(ca, stranger)])
    save("job", 1, seeded_state(1, N, tag="tls"), node=a, staged=False)
    with DaemonClient.from_socket(a.socket) as c:
        rep = wait_until(
            "a refused push", lambda: (s := c.status().replication) and s.last_error and s
        )
    assert rep.last_error is not None
    assert f"peer {b.name}: its TLS certificate was refused" in rep.last_error
    assert "unable to get local issuer certificate" in rep.last_error
    assert str(ca.path) in rep.last_error  # says which CA it must come from
    assert rep.unreachable == [b.name]
    info = _steps(a, "job")[1]
    assert info.replication_pending and info.replicated_to == []  # kept until replicated
    with DaemonClient.from_socket(b.socket) as c:
        assert c.namespaces() == []  # nothing reached the stranger
    assert TOKEN not in a.log() and TOKEN not in b.log()

    # The daemon's port checks a caller's certificate when one is presented: the stranger's
    # is refused at the handshake, the cluster's is served; none at all (a probe) is served.
    url = f"https://127.0.0.1:{a.settings['port']}/healthz"
    for presented, served in ((stranger, False), (good, True), (None, True)):
        context = ssl.create_default_context(cafile=str(ca.path))
        if presented is not None:
            context.load_cert_chain(*presented)
        with httpx.Client(verify=context, timeout=10) as client:
            if served:
                assert client.get(url).status_code == 200
            else:
                with pytest.raises(httpx.HTTPError):
                    client.get(url)


@pytest.mark.slow
def test_a_daemon_with_tls_says_when_its_peer_has_none(
    tmp_path: Path, make_ring: Callable[..., list[DaemonProcess]]
) -> None:
    ca = CA.make(tmp_path, "cluster-ca")
    a, b = make_ring(
        2,
        token=TOKEN,
        per_node=[tls_settings(ca, ca.issue(tmp_path, "node0", dns=[], ips=["127.0.0.1"])), {}],
    )
    save("job", 1, seeded_state(1, N, tag="tls"), node=a, staged=False)
    with DaemonClient.from_socket(a.socket) as c:
        rep = wait_until(
            "a failed push", lambda: (s := c.status().replication) and s.last_error and s
        )
    assert rep.last_error is not None
    assert f"peer {b.name}: it does not speak TLS" in rep.last_error
    assert _steps(a, "job")[1].replication_pending
    with DaemonClient.from_socket(b.socket) as c:
        assert c.namespaces() == []


# -- settings that stop the daemon ---------------------------------------------------------------------


def _run_daemon(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TIERCKPT_")}
    full_env.update(env, TIERCKPT_SHM_DIR=str(tmp_path / "tier"), TIERCKPT_PORT="0")
    return subprocess.run(
        [sys.executable, "-m", "tierckpt_daemon"],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "case",
    ["only_cert", "cert_and_ca", "unreadable_key", "mismatched_key", "not_pem_ca", "name_alone"],
)
def test_incomplete_or_unusable_tls_settings_stop_the_daemon(tmp_path: Path, case: str) -> None:
    ca = CA.make(tmp_path, "cluster-ca")
    cert, key = ca.issue(tmp_path, "node0", dns=[], ips=["127.0.0.1"])
    other_cert, _ = ca.issue(tmp_path, "node1", dns=[], ips=["127.0.0.1"])
    full = {
        "TIERCKPT_PEER_TLS_CERT": str(cert),
        "TIERCKPT_PEER_TLS_KEY": str(key),
        "TIERCKPT_PEER_TLS_CA": str(ca.path),
    }
    env, message = {
        "only_cert": (
            {"TIERCKPT_PEER_TLS_CERT": str(cert)},
            "TIERCKPT_PEER_TLS_KEY, TIERCKPT_PEER_TLS_CA are missing",
        ),
        "cert_and_ca": (
            {"TIERCKPT_PEER_TLS_CERT": str(cert), "TIERCKPT_PEER_TLS_CA": str(ca.path)},
            "TIERCKPT_PEER_TLS_KEY is missing",
        ),
        "unreadable_key": (
            {**full, "TIERCKPT_PEER_TLS_KEY": str(tmp_path / "absent.key")},
            f"TIERCKPT_PEER_TLS_KEY {tmp_path / 'absent.key'}: cannot read it",
        ),
        "mismatched_key": (
            {**full, "TIERCKPT_PEER_TLS_CERT": str(other_cert)},
            "not a PEM certificate and its private key",
        ),
        "not_pem_ca": (
            {**full, "TIERCKPT_PEER_TLS_CA": str(key)},
            "no usable PEM certificate in it",
        ),
        "name_alone": (
            {"TIERCKPT_PEER_TLS_SERVER_NAME": SERVER_NAME},
            "TIERCKPT_PEER_TLS_SERVER_NAME is set but TLS is off",
        ),
    }[case]
    proc = _run_daemon(tmp_path, env)
    assert proc.returncode == 2, proc.stderr
    assert "invalid setting" in proc.stderr and message in proc.stderr
    assert "BEGIN" not in proc.stderr  # no key material in the error


def test_tls_needs_the_tcp_port(tmp_path: Path) -> None:
    ca = CA.make(tmp_path, "cluster-ca")
    cert, key = ca.issue(tmp_path, "node0", dns=[], ips=["127.0.0.1"])
    proc = _run_daemon(
        tmp_path,
        {
            "TIERCKPT_PEER_TLS_CERT": str(cert),
            "TIERCKPT_PEER_TLS_KEY": str(key),
            "TIERCKPT_PEER_TLS_CA": str(ca.path),
        },
    )
    assert proc.returncode == 2, proc.stderr
    assert "the TCP port is off" in proc.stderr
