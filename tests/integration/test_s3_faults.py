"""The persistent tier under S3 faults: a real daemon uploads to real SeaweedFS through a loopback
proxy (tests/s3proxy.py) that throttles, fails, resets, truncates, corrupts, delays and stalls
requests. What a user must see: every committed step becomes durable within the retry budget;
restore is bit-exact or fails loudly, never wrong bytes; a failure that outlasts the budget (or a
server that stops answering) shows in status and metrics within the S3 timeout while the step
stays in memory; and the upload queue moves on.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from s3proxy import Fault, S3FaultProxy
from seaweed import SeaweedS3
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client import DaemonClient
from tierckpt_core.protocol import PersistentStatus

from helpers import DaemonProcess, free_port, wait_until
from kit import blank_state, cli, load, save, seeded_state, step_states, wait_durable

N = 1 << 16
BIG = 5 << 20  # floats: 20 MiB, three multipart parts of 8 MiB

_T = TypeVar("_T")


def _assert_state(out: dict[str, object], step: int, n: int = N) -> None:
    ref = seeded_state(step, n)
    assert torch.equal(out["w"], ref["w"])  # type: ignore[arg-type]
    assert out["meta"] == {"step": step}


def _persistent() -> PersistentStatus:
    with DaemonClient() as c:
        st = c.status().persistent
    assert st is not None
    return st


def _wait(what: str, probe: Callable[[], _T | None], timeout: float) -> _T:
    return wait_until(what, probe, timeout, describe=lambda: f"persistent: {_persistent()}")


def _stalled_at(proxy: S3FaultProxy) -> float:
    """When the proxy first held a request (``time.monotonic()``): the S3 timeout runs from
    there, whereas the save before it and the niced upload's way to it take what the machine's
    load makes them take."""
    return min(t for t, _op, _path, fault in proxy.log if fault == "stall")


def _scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    # Labelled series summed under their name (tierckpt_verification_failures_total{tier}).
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture
def proxy(seaweed: SeaweedS3) -> Iterator[S3FaultProxy]:
    with S3FaultProxy(seaweed.endpoint) as p:
        yield p


@pytest.fixture
def start_node(
    s3_env: SeaweedS3,
    proxy: S3FaultProxy,
    request: pytest.FixtureRequest,
    make_node: Callable[..., DaemonProcess],
) -> Callable[..., DaemonProcess]:
    """Start a daemon whose persistent tier is SeaweedFS behind ``proxy``."""
    prefix = request.node.name

    def start(**settings: object) -> DaemonProcess:
        return make_node(
            client=True,
            persist_url=f"s3://{s3_env.bucket}/{prefix}",
            s3_endpoint=proxy.endpoint,
            port=free_port(),
            host="127.0.0.1",
            **{"keep_last": 4, **settings},  # (4: a test's steps stay, unless it says)
        )

    return start


def _reboot(node: DaemonProcess) -> None:
    """A node that lost its memory: kill the daemon, wipe the tmpfs tier, start again."""
    node.kill()
    shutil.rmtree(node.shm_dir)
    node.start()


@pytest.mark.slow
def test_transient_faults_every_step_becomes_durable_and_restores_bit_exact(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy
) -> None:
    node = start_node(s3_timeout=10, s3_max_attempts=4)
    # Uploads: throttling, internal errors, resets before and in the middle of a body, latency.
    proxy.add("503", op="UploadPart", times=3)
    proxy.add("500", op="CompleteMultipartUpload", times=2)
    proxy.add("reset", op="CreateMultipartUpload", times=2)
    proxy.add("reset_body", op="UploadPart", times=2)
    proxy.add(Fault("delay", 0.5), op="UploadPart", times=3)
    proxy.add("503", op="DeleteObjects", times=1)
    for step in (1, 2, 3):
        save("job", step, seeded_state(step, BIG if step == 2 else N))
    wait_durable("job", {1, 2, 3})
    # Durable first, then the uploader's retention pass (its DeleteObjects faulted once and
    # retried) before the step leaves the queue: the queue drains, bounded.
    st = _wait(
        "the upload queue to drain",
        lambda: st if (st := _persistent()).queued_steps == 0 else None,
        60,
    )
    assert st.uploaded_steps == 3 and st.healthy is True and st.last_error is None
    upload_faults = proxy.injected()
    assert upload_faults == 13, proxy.faults

    # Restore after a node loss, through failed, cut-short and lying downloads.
    proxy.clear()
    proxy.add("503", op="GetObject", times=2)
    proxy.add("reset", op="GetObject", times=2)
    proxy.add("truncate", op="GetObject", times=2)
    proxy.add("short", op="GetObject", times=2)
    proxy.add("503", op="ListObjects", times=1)
    _reboot(node)
    step, out = load("job", blank_state(N))
    assert step == 3
    _assert_state(out, 3)
    _step, out = load("job", blank_state(BIG), 2)
    _assert_state(out, 2, BIG)
    _step, out = load("job", blank_state(N), 1)
    _assert_state(out, 1)
    assert proxy.injected() - upload_faults == 9, proxy.faults
    # Each retry is one line in our words, not tenacity's (which names a private function).
    log = node.log_path.read_text()
    assert "(attempt 1 of 4); trying again in" in log
    assert "Retrying tierckpt" not in log
    print(f"faults injected: {dict(proxy.faults)}; requests: {dict(proxy.requests)}")


@pytest.mark.slow
def test_corrupted_transfers_are_never_restored(
    start_node: Callable[..., DaemonProcess],
    proxy: S3FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = start_node(s3_timeout=10, s3_max_attempts=2)
    save("job", 10, seeded_state(10, N))
    wait_durable("job", {10})
    # Step 20's data is corrupted on its way up (plain HTTP, unsigned payload: S3 stores it).
    proxy.add("flip_body", op="UploadPart", key=r"step_000000000020/r\d+\.data")
    save("job", 20, seeded_state(20, N))
    save("job", 30, seeded_state(30, N))
    wait_durable("job", {20, 30})
    # Step 30 is stored intact, but every download of its data is corrupted on the way back.
    proxy.clear()
    proxy.add("flip", op="GetObject", key=r"step_000000000030/r\d+\.data")
    _reboot(node)
    with caplog.at_level(logging.WARNING, logger="tierckpt_client.dcp.reader"):
        step, out = load("job", blank_state(N))
    assert step == 10
    _assert_state(out, 10)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("skipping step 30" in w and "corrupt" in w for w in warnings), warnings
    assert any("skipping step 20" in w and "corrupt" in w for w in warnings), warnings
    for bad in (20, 30):
        with pytest.raises(CheckpointException, match=r"r00000\.data .* is corrupt"):
            load("job", blank_state(N), bad)
    assert proxy.faults["flip GetObject"] >= 1 and proxy.faults["flip_body UploadPart"] >= 1
    assert _scrape(node.settings["port"])["tierckpt_verification_failures_total"] >= 2


@pytest.mark.slow
def test_exhausted_retries_show_in_status_and_metrics_and_the_step_stays_in_memory(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy
) -> None:
    node = start_node(s3_timeout=5, s3_max_attempts=2)
    port = node.settings["port"]
    rule = proxy.add("503", op="UploadPart")  # S3 throttles every upload, for as long as it takes
    save("job", 1, seeded_state(1, N))
    st = _wait("a failed upload", lambda: (s := _persistent()).failed_uploads and s, 30)
    assert st.healthy is False
    assert "job/step 1: upload to s3://" in (st.last_error or "")
    assert "throttled" in (st.last_error or "")  # the CRT client's words for 503 SlowDown
    assert st.queued_steps == 1
    metrics = _scrape(port)
    assert metrics["tierckpt_persistent_healthy"] == 0
    assert metrics["tierckpt_upload_failures_total"] >= 1
    assert metrics["tierckpt_upload_queue_steps"] == 1
    assert metrics["tierckpt_due_steps_since_durable"] == 1  # TierckptNoDurableStep's count
    assert step_states("job") == {1: "committed"}
    _step, out = load("job", blank_state(N))  # the memory tier keeps serving it
    _assert_state(out, 1)
    assert rule.hits >= 2

    proxy.clear()  # S3 recovers: the step becomes durable, and status healthy again
    wait_durable("job", {1})
    st = _persistent()
    assert st.healthy is True and st.last_error is None and st.queued_steps == 0
    metrics = _scrape(port)
    assert metrics["tierckpt_persistent_healthy"] == 1
    assert metrics["tierckpt_due_steps_since_durable"] == 0


@pytest.mark.parametrize("denial", ["deny_each", "403"])
def test_a_policy_without_delete_names_the_action_uploads_need(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy, denial: str
) -> None:
    """An upload first removes the step's marker: a policy that denies s3:DeleteObject (S3
    answers each key AccessDenied; some servers refuse the whole request) failed every upload
    with "deleting from s3://... failed", which reads like retention, not uploads. An outage on
    that first call does not point at the policy."""
    start_node(s3_timeout=5, s3_max_attempts=1)
    proxy.add(denial, op="DeleteObjects")
    save("job", 1, seeded_state(1, N))
    st = _wait("a failed upload", lambda: (s := _persistent()).failed_uploads and s, 30)
    error = st.last_error or ""
    assert "job/step 1: upload to s3://" in error, error
    assert "(the upload's first call, removing any earlier COMMITTED marker" in error, error
    assert "the S3 policy must allow s3:DeleteObject" in error, error
    assert "AccessDenied" in error, error
    proxy.clear()
    proxy.add("503", op="DeleteObjects")
    save("job", 2, seeded_state(2, N))
    st = _wait(
        "a failed upload of step 2",
        lambda: "job/step 2" in ((s := _persistent()).last_error or "") and s,
        30,
    )
    error = st.last_error or ""
    assert "(the upload's first call, removing any earlier COMMITTED marker" in error, error
    assert error.index("job/step 2: upload to s3://") < error.index("first call"), error
    assert "s3:DeleteObject" not in error, error
    proxy.clear()
    wait_durable("job", {1, 2})


def test_a_stop_that_waits_for_queued_uploads_says_so(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy
) -> None:
    """SIGTERM with an upload queued and S3 down waited the drain timeout without a word."""
    node = start_node(s3_timeout=4, s3_max_attempts=1, drain_timeout_s=3)
    proxy.add("503", op="UploadPart")
    save("job", 1, seeded_state(1, N))
    _wait("a failed upload", lambda: _persistent().failed_uploads, 30)
    t0 = time.monotonic()
    node.stop()
    assert time.monotonic() - t0 < 30
    log = node.log_path.read_text()
    assert "stopping: waiting up to 3s (TIERCKPT_DRAIN_TIMEOUT_S) for 1 queued upload(s)" in log
    assert "the tier is unhealthy: job/step 1: upload to s3://" in log
    assert "uploads not finished after 3s (job/step 1); they resume when a daemon starts" in log
    assert (node.shm_dir / "UPLOADS_PENDING").read_text() == "job/step 1\n"


@pytest.mark.slow
def test_a_stalled_upload_is_bounded_by_the_timeout_and_the_queue_moves_on(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy
) -> None:
    timeout = 3.0
    node = start_node(s3_timeout=timeout, s3_max_attempts=1)
    # The server stops answering the upload of step 1's data (as if stopped with SIGSTOP).
    proxy.add("stall", op="UploadPart", key=r"step_000000000001/")
    save("job", 1, seeded_state(1, N))
    # Uploads run niced: on a loaded machine they may take a while to reach the stalled part.
    assert _wait("the upload to start", lambda: proxy.faults["stall UploadPart"], 60)
    st = _persistent()
    assert st.queued_steps == 1 and st.failed_uploads == 0  # one step, in flight
    st = _wait("the stalled upload to fail", lambda: (s := _persistent()).failed_uploads and s, 30)
    elapsed = time.monotonic() - _stalled_at(proxy)  # from the stall, not from the save
    print(f"stalled upload reported after {elapsed:.1f}s (TIERCKPT_S3_TIMEOUT={timeout:g})")
    assert elapsed < 3 * timeout, f"a stalled upload took {elapsed:.1f}s to fail"
    assert st.healthy is False and "TIERCKPT_S3_TIMEOUT=3s" in (st.last_error or "")
    assert _scrape(node.settings["port"])["tierckpt_persistent_healthy"] == 0

    save("job", 2, seeded_state(2, N))  # committed behind the stuck step: it must not wait for it
    wait_durable("job", {2}, timeout=30)
    assert step_states("job")[1] == "committed"
    _step, out = load("job", blank_state(N), 1)
    _assert_state(out, 1)

    proxy.clear()
    proxy.release()  # the server answers again: step 1 follows
    wait_durable("job", {1}, timeout=60)
    assert _persistent().queued_steps == 0


@pytest.mark.slow
def test_a_server_that_stops_answering_everything_is_reported_within_the_timeout(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy
) -> None:
    timeout = 4.0
    start_node(s3_timeout=timeout, s3_max_attempts=1)
    _wait("the start-up health check", lambda: _persistent().healthy, 30)
    proxy.add("stall")  # control calls (boto3) and data calls (CRT) alike
    save("job", 1, seeded_state(1, N))
    st = _wait("the stalled upload to fail", lambda: (s := _persistent()).failed_uploads and s, 60)
    elapsed = time.monotonic() - _stalled_at(proxy)  # from the stall, not from the save
    print(f"stalled server reported after {elapsed:.1f}s (TIERCKPT_S3_TIMEOUT={timeout:g})")
    # One attempt (TIERCKPT_S3_MAX_ATTEMPTS=1) of one timeout, not one per boto3 retry on top.
    assert elapsed < 2 * timeout, f"a stalled server took {elapsed:.1f}s to be reported"
    assert st.healthy is False and st.queued_steps == 1
    assert "TIERCKPT_S3_TIMEOUT=4s" in (st.last_error or "")
    assert step_states("job") == {1: "committed"}
    proxy.clear()
    proxy.release()
    wait_durable("job", {1}, timeout=60)


def test_an_outage_shows_in_status_while_no_upload_is_queued(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy
) -> None:
    """Health was the uploads' alone: with nothing to upload, an S3 outage left status
    "healthy" (and `tierckpt_persistent_healthy` 1) while every "latest" failed to list the
    tier. A failed listing now marks it unhealthy, and a listing that works again healthy.
    `tierckpt ls` exited 0 with the memory tier's steps only, as if S3 held no other: it now
    shows them and fails, naming the outage."""
    node = start_node(s3_timeout=4.0, s3_max_attempts=1)
    _wait("the start-up health check", lambda: _persistent().healthy, 30)
    save("job", 1, seeded_state(1, N))
    wait_durable("job", {1}, timeout=60)
    proxy.add("503")  # every call fails, none is forwarded
    step, out = load("job", blank_state(N))  # from memory: the outage never blocks it
    assert step == 1
    _assert_state(out, 1)
    st = _persistent()
    assert st.healthy is False and st.queued_steps == 0, st
    assert "listing job in s3://" in (st.last_error or ""), st.last_error
    ls = cli("ls", "job", node=node)
    assert ls.returncode == 1, (ls.stdout, ls.stderr)
    assert "cannot list the persistent tier s3://" in ls.stderr, ls.stderr
    assert re.search(r"^1 +durable ", ls.stdout, re.M), ls.stdout  # what memory holds, shown
    proxy.clear()
    load("job", blank_state(N))
    assert _persistent().healthy is True
    assert cli("ls", "job", node=node).returncode == 0


def test_an_endpoint_that_refuses_connections_is_named_in_words(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy
) -> None:
    """A prefetch while the S3 endpoint is down answered the CRT client's own text ("Client
    error: Unknown CRT error: CRT error 1047: aws-c-io: ..."): it now says what happened."""
    node = start_node(s3_timeout=4, s3_max_attempts=1)
    save("job", 1, seeded_state(1, N))
    wait_durable("job", {1}, timeout=60)
    _reboot(node)
    proxy.close()  # nothing listens on the endpoint's port any more
    proc = cli("prefetch", "job", "1", node=node)
    assert proc.returncode == 1, proc.stderr
    assert "the S3 endpoint refused the connection" in proc.stderr, proc.stderr
    assert "[AWS_IO_SOCKET_CONNECTION_REFUSED]" in proc.stderr
    assert "Unknown CRT error" not in proc.stderr


def test_a_hung_tier_holds_a_restore_from_memory_up_a_few_seconds_not_its_timeout(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy
) -> None:
    """A persistent tier that stops answering (as SeaweedFS under SIGSTOP) held every restore of
    "latest" up for its whole timeout (60 s by default) though the newest step was in memory:
    the listing now gets a few seconds when memory holds steps, and the tier shows unhealthy."""
    from tierckpt_daemon.tier.restore import LISTING_WAIT_S

    start_node(s3_timeout=30.0, s3_max_attempts=1)
    _wait("the start-up health check", lambda: _persistent().healthy, 30)
    save("job", 1, seeded_state(1, N))
    wait_durable("job", {1}, timeout=60)
    proxy.add("stall")
    t0 = time.monotonic()
    step, out = load("job", blank_state(N))
    took = time.monotonic() - t0
    assert step == 1
    _assert_state(out, 1)
    assert took < LISTING_WAIT_S + 10, f"a restore from memory took {took:.1f}s"
    st = _persistent()
    assert st.healthy is False and "did not answer a listing within" in (st.last_error or "")
    proxy.clear()
    proxy.release()


@pytest.mark.slow
def test_an_outage_longer_than_the_saves_keeps_the_newest_due_step_until_it_is_durable(
    start_node: Callable[..., DaemonProcess], proxy: S3FaultProxy
) -> None:
    """With the tier down (or saves faster than uploads), retention dropped every step due for
    the persistent tier before its upload: after the outage none of them became durable (only
    later saves did). Now the newest step due stays in memory until it is durable; older due
    ones go, each said and counted as skipped."""
    node = start_node(s3_timeout=5, s3_max_attempts=2, keep_last=1)
    port = node.settings["port"]
    proxy.add("503")  # every request: the tier is down
    for step in range(1, 5):
        save("job", step, seeded_state(step, N))
    # keep_last 1: the newest, which is also the newest due; step 3 while its upload attempt
    # lasts (then it goes: retention runs again when an upload attempt ends).
    _wait("only step 4 in memory", lambda: step_states("job") == {4: "committed"} or None, 30)
    save("job", 5, seeded_state(5, N), persist=False)  # a step not due: 4 stays for its upload
    assert step_states("job") == {4: "committed", 5: "committed"}
    skipped = lambda: _scrape(port)["tierckpt_upload_skips_total"] >= 3 or None  # noqa: E731
    _wait("steps 1-3 said and counted as not uploaded", skipped, 60)
    proxy.clear()  # the tier is back: the newest due step becomes durable

    def durable() -> list[int]:
        with DaemonClient() as c:  # in the persistent tier (it may have left memory since)
            return [x.step for x in c.candidates("job", complete=True) if x.durable]

    assert _wait("step 4 durable", lambda: durable() or None, 60) == [4]
