"""The daemon's HTTP API against requests generated from its own OpenAPI document (schemathesis):
the local routes over the Unix socket, the peer and probe routes over the TCP port with the peer
token, on one real daemon process with a real tier directory and a file:// persistent tier.

Each answer must come within the per-request timeout, must not be a server error (a 5xx other
than 507, which says a lease cannot fit the memory budget), and must match the document: a
status code it lists, the content type and the body schema it gives for that code. After the
run the daemon still answers and its log holds no traceback. The daemon starts with two committed
steps, and the test adds the naming rules to the document's path parameters, so that generated
requests reach real steps and files rather than stopping at name validation.

Short mode (CI): a fixed, derandomized set of about 260 requests (under a minute). ``TIERCKPT_LONG=1``:
random generation plus schemathesis' coverage phase, more than 3,000 requests (about 5 minutes).
``-s`` prints the answers by operation and status.
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
import urllib3
from hypothesis import HealthCheck, settings
from requests.adapters import HTTPAdapter
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tierckpt_client import DaemonClient
from tierckpt_core.names import MAX_STEP
from tierckpt_core.protocol import CommitRequest, SealFile

from helpers import DaemonProcess, free_port, started

LONG = os.environ.get("TIERCKPT_LONG") == "1"
EXAMPLES = 90 if LONG else 10  # per operation; 30 operations
TIMEOUT_S = 15.0  # per request: a hang fails the test instead of stalling it
TOKEN = "peer-token-for-the-fuzz-tests-0123456789"
# 507: a lease larger than the budget, answered as the documented capacity error.
ALLOWED_5XX = {507}
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not LONG,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


# -- requests over the daemon's Unix socket --------------------------------------------------------


class _UnixConnection(urllib3.connection.HTTPConnection):
    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__("localhost", **kwargs)
        self._path = path

    def _new_conn(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT_S)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        return sock


class _UnixPool(urllib3.HTTPConnectionPool):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=TIMEOUT_S)
        self._path = path

    def _new_conn(self) -> _UnixConnection:
        return _UnixConnection(self._path, timeout=TIMEOUT_S)


class _UnixAdapter(HTTPAdapter):
    """Sends every request of a ``requests`` session to one Unix socket."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._pool = _UnixPool(path)

    def get_connection_with_tls_context(self, *args: Any, **kwargs: Any) -> _UnixPool:
        return self._pool

    def close(self) -> None:
        self._pool.close()
        super().close()


# -- the daemon under test ------------------------------------------------------------------------------


class Target:
    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon = daemon
        self.tcp = f"http://127.0.0.1:{daemon.settings['port']}"
        self.local = requests.Session()
        self.local.trust_env = False
        self.local.mount("http://tierckpt/", _UnixAdapter(str(daemon.socket)))
        self.remote = requests.Session()
        self.remote.trust_env = False
        self.statuses: dict[str, int] = {}
        self.document: dict[str, Any] = self.local.get(
            "http://tierckpt/openapi.json", timeout=TIMEOUT_S
        ).json()

    def close(self) -> None:
        self.local.close()
        self.remote.close()


def _seed(d: DaemonProcess) -> None:
    """Committed steps 0 and 1 of namespace "0" (the names generation tries first), so that
    requests reach real steps, files and pins, not only 404s. Through the daemon's own API (a
    lease, the bytes, a seal, a commit), torch-free."""
    with DaemonClient.from_socket(d.socket) as c:
        for step in (0, 1):
            data = os.urandom(64 << 10)
            lease = c.lease("0", 0, len(data))
            with open(lease.path, "r+b") as f:
                f.write(data)
            name = "0"  # also the file name generation tries first
            c.seal(
                "0", step, "a1", 0, [SealFile(lease_id=lease.lease_id, name=name, length=len(data))]
            )
            c.commit(
                "0",
                step,
                "a1",
                CommitRequest(files=[name], metadata={"seeded": True}, world_size=1),
            )


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    store = tmp_path_factory.mktemp("fuzz-store")
    port = free_port()
    with started(
        capacity="64M",
        prefault="false",
        host="127.0.0.1",
        port=port,
        node_name=f"127.0.0.1:{port}",
        peers=f"127.0.0.1:{port}",  # a ring of one: the peer routes are on, nobody to push to
        peer_token=TOKEN,
        persist_url=f"file://{store}",
    ) as d:
        _seed(d)
        t = Target(d)
        try:
            yield t
        finally:
            t.close()
            log = d.log()
    summary = "\n".join(f"  {k}: {v}" for k, v in sorted(t.statuses.items()))
    print(f"\nfuzzed {sum(t.statuses.values())} requests:\n{summary}")
    assert "Traceback" not in log, log


def _schema(target: Target) -> Any:
    # Short mode: the schema's examples and random generation. Long mode adds the coverage
    # phase (every boundary and negative case the schema implies, deterministic).
    config = SchemathesisConfig.from_dict(
        {"phases": {"coverage": {"enabled": LONG}, "stateful": {"enabled": False}}}
    )
    return schemathesis.openapi.from_dict(_with_naming_rules(target.document), config=config)


# The naming rules the daemon enforces (tierckpt_core.names), which its document does not state:
# with them, generated names and steps get past validation to the code behind it.
NAME_PARAMS = {"namespace", "name", "attempt", "lease_id", "pin_id"}
NAME_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"}
STEP_SCHEMA = {"type": "integer", "minimum": 0, "maximum": MAX_STEP}


def _with_naming_rules(document: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(document)
    for ops in doc["paths"].values():
        for op in ops.values():
            for param in op.get("parameters", []):
                if param["in"] == "path" and param["name"] in NAME_PARAMS:
                    param["schema"] = dict(NAME_SCHEMA)
                elif param["in"] == "path" and param["name"] == "step":
                    param["schema"] = dict(STEP_SCHEMA)
    return doc


@pytest.fixture(scope="module")
def schema(target: Target) -> Any:
    return _schema(target)


def _check(target: Target, case: Any, response: requests.Response) -> None:
    key = f"{case.operation.label} {response.status_code}"
    target.statuses[key] = target.statuses.get(key, 0) + 1
    if response.status_code >= 500 and response.status_code not in ALLOWED_5XX:
        raise AssertionError(
            f"{case.method} {case.formatted_path} answered {response.status_code}: "
            f"{response.text[:500]}\n{target.daemon.log()[-2000:]}"
        )
    case.validate_response(response, checks=CHECKS)


# Local routes go to the Unix socket; peer routes and probes to the TCP port (the other way
# round, each answers 403: tests/integration/test_replication.py checks that).
LOCAL = schemathesis.pytest.from_fixture("schema").exclude(path_regex="^/v1/peer/")
REMOTE = schemathesis.pytest.from_fixture("schema").include(
    path_regex="^(/v1/peer/|/healthz|/readyz|/metrics)"
)


@pytest.mark.slow
@LOCAL.parametrize()
@FUZZ_SETTINGS
def test_local_routes_over_the_unix_socket(case: Any, target: Target) -> None:
    response = case.call(base_url="http://tierckpt", session=target.local, timeout=TIMEOUT_S)
    _check(target, case, response)


@pytest.mark.slow
@REMOTE.parametrize()
@FUZZ_SETTINGS
def test_peer_routes_over_tcp_with_the_token(case: Any, target: Target) -> None:
    response = case.call(
        base_url=target.tcp,
        session=target.remote,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=TIMEOUT_S,
    )
    _check(target, case, response)


def test_the_daemon_still_answers_after_the_fuzz(target: Target) -> None:
    status = target.daemon.status()
    assert status is not None and status["capacity_bytes"] == 64 << 20
    assert status["used_bytes"] <= status["capacity_bytes"]
    assert "Traceback" not in target.daemon.log()


# -- what the fuzz found, pinned --------------------------------------------------------------------


def test_a_body_that_is_not_utf8_gets_a_400_with_a_code(target: Target) -> None:
    # FastAPI answered {"detail": "There was an error parsing the body"}, without the code that
    # clients map to an exception class and that the document promises.
    r = target.local.post(
        "http://tierckpt/v1/namespaces/job/leases",
        data=b"\xff\xfe{",
        headers={"Content-Type": "application/json"},
        timeout=TIMEOUT_S,
    )
    assert r.status_code == 400
    assert r.json()["code"] == "protocol"
    assert "error parsing the body" in r.json()["detail"] and "/leases" in r.json()["detail"]


def test_framework_errors_answer_in_the_daemon_error_shape(target: Target) -> None:
    r = target.local.get("http://tierckpt/v1/no-such-route", timeout=TIMEOUT_S)
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = target.local.put("http://tierckpt/v1/status", timeout=TIMEOUT_S)
    assert r.status_code == 405 and r.json()["code"] == "protocol"
    assert r.headers["allow"] == "GET"


def test_the_document_describes_every_error_answer(target: Target) -> None:
    ref = "#/components/schemas/ErrorBody"
    for path, ops in target.document["paths"].items():
        for method, op in ops.items():
            for status in ("4XX", "5XX"):
                schema = op["responses"][status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": ref}, (method, path, status)
            # No FastAPI-shaped 422 ({"detail": [...]}): the daemon never answers that.
            assert "422" not in op["responses"], (method, path)
    assert target.document["components"]["schemas"]["ErrorBody"]["required"] == ["code", "detail"]
