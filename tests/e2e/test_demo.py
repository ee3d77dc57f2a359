"""The README's demo command: 4 ranks on 2 nodes, node B lost, resume from peer memory."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_resumes_after_node_loss_from_peer_memory() -> None:
    env = dict(os.environ)
    env.pop("TIERCKPT_SOCKET", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tierckpt_client.demo"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # Every step was saved (a stall printed for each), and the job resumed from the last one.
    assert len(re.findall(r"save stall +[\d.]+ ms", out)) == 6
    assert "resumed from step 6" in out
    # Node B's share came from node A's memory, nothing from the persistent tier.
    peer = re.search(r"peers ([\d.]+) MB", out)
    assert peer is not None and float(peer.group(1)) > 0
    assert "persistent tier 0.00 MB" in out
    # The resumed losses equal the uninterrupted run's, step by step.
    equal = re.findall(r"step +(\d+)  loss ([\d.]+)  uninterrupted ([\d.]+)  equal", out)
    assert [int(s) for s, _, _ in equal] == [7, 8, 9, 10]
    assert all(a == b for _, a, b in equal)
    assert "DIFFERENT" not in out
