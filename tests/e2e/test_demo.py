"""The README's demo command: train, lose the node, resume from the persistent tier."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_resumes_after_node_loss(tmp_path: object) -> None:
    env = dict(os.environ)
    env.pop("TIERCKPT_SOCKET", None)
    env["TIERCKPT_SHM_DIR"] = "/dev/shm/tierckpt-demo-test-no-daemon"  # nothing listens there
    proc = subprocess.run(
        [sys.executable, "-m", "tierckpt_client.demo"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "started an embedded daemon" in out
    assert "[rank 0] resumed from step 20 of demo-job" in out
    assert "step   40  durable" in out
