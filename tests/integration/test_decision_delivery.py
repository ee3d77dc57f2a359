"""A decision a participant did not take is told again, but not forever (issue 32, item 3): not
at all once it answers that it cannot take it (a replacement node: "no save in progress"), and no
longer than ``TIERCKPT_DECISION_RESEND_S`` while it cannot be reached. Each end is a WARNING and
counts in ``tierckpt_decision_deliveries_abandoned_total{reason}``. Real daemons on a ring."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator

import httpx
import pytest
from commit_kit import NS, TOKEN, decide, latest, prepare, until

from helpers import DaemonProcess, ring, running
from kit import seal_bytes

ABANDONED = "tierckpt_decision_deliveries_abandoned_total"


@pytest.fixture
def two() -> Iterator[list[DaemonProcess]]:
    nodes = ring(
        2,
        token=TOKEN,
        replicas=0,
        prefix="tierckpt-test",
        log_level="INFO",
        per_node=[{"decision_resend_s": 3}, {}],
    )
    with running(nodes) as ds:
        yield ds


def _abandoned(d: DaemonProcess, reason: str) -> float:
    text = httpx.get(f"http://{d.name}/metrics", timeout=10).text
    found = re.search(rf'^{ABANDONED}\{{reason="{reason}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _decide_relaying_to(a: DaemonProcess, b: DaemonProcess, before: object = None) -> None:
    """Step 1 sealed on ``a`` (the decider) and ``b``, prepared on ``b``; ``before()`` runs;
    then ``a`` prepares its share, takes the decision and relays it to ``b``."""
    assert a.name and b.name
    both = [a.name, b.name]
    seal_bytes(a, NS, 1, "s1", 0, 20_000)
    seal_bytes(b, NS, 1, "s1", 1, 20_000)
    files = prepare(a, b, 1, "s1", "r00001.data", both)
    if callable(before):
        before()
    # The decider's own share last: it aborts a prepared attempt of its own it has not decided
    # within seconds (in the real commit both come in one call).
    files += prepare(a, a, 1, "s1", "r00000.data", both)
    decide(a, 1, "s1", files, relay=[b.name])
    assert latest(a) == 1


def test_a_decision_a_replacement_node_cannot_take_is_not_sent_again(
    two: list[DaemonProcess],
) -> None:
    a, b = two

    def replace_b() -> None:  # prepared, then the node is replaced: its memory is gone
        b.kill()
        shutil.rmtree(b.shm_dir)
        b.start()

    _decide_relaying_to(a, b, replace_b)
    until("the delivery to be abandoned", lambda: _abandoned(a, "refused") == 1, 30)
    time.sleep(5)  # rounds of the resolver: nothing is sent again, nothing counted again
    assert _abandoned(a, "refused") == 1
    warned = [line for line in a.log().splitlines() if "is no longer sent to" in line]
    assert len(warned) == 1 and b.name in warned[0] and "WARNING" in warned[0], warned


def test_a_decision_is_not_sent_forever_to_a_node_that_stays_down(
    two: list[DaemonProcess],
) -> None:
    a, b = two
    _decide_relaying_to(a, b, b.kill)
    # Re-sent after 2 s, then 4 s later: past TIERCKPT_DECISION_RESEND_S (3 s), abandoned.
    until("the delivery to expire", lambda: _abandoned(a, "expired") == 1, 30)
    assert _abandoned(a, "refused") == 0
