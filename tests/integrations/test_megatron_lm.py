"""tierckpt_client.integrations.megatron_lm: Megatron-LM's own ``save_checkpoint`` and
``load_checkpoint`` (``megatron.training.checkpointing``) with tierckpt installed, on 2 gloo ranks
with a real daemon (tests/integrations/megatron_lm_run.py: a tiny GPTModel at TP=2, CPU).

Checks what a Megatron-LM user sees: a sync and an ``--async-save`` step restored bit-exact
(weights changed right after the async save returned never reach it), the tracker
``latest_checkpointed_iteration.txt`` naming a step only once it is committed, and "latest" after
a crash — a newer step sealed but never committed, and a tracker naming it — is tierckpt's newest
committed step.

Needs Megatron-LM's ``megatron.training`` (in the megatron-core 0.19.2 wheel, Python >= 3.12;
docs/guides/megatron.md has the venv); skipped without it (megatron-core 0.16.1 has none)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the [megatron] extra)")
pytest.importorskip(
    "megatron.training.checkpointing",
    reason="Megatron-LM's megatron.training is not in this megatron-core (0.19.2 has it)",
)

from tierckpt_client import DaemonClient

from helpers import DaemonProcess, run_loop
from kit import seal_bytes

SCRIPT = Path(__file__).resolve().parent / "megatron_lm_run.py"


@pytest.mark.slow
def test_megatron_lm_save_and_load_checkpoint_through_tierckpt(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    ns = "mlm"
    # A save of step 5 that died before its commit: sealed on this node, never committed.
    seal_bytes(daemon, ns, 5, uuid.uuid4().hex, 0, 4096)
    folder = tmp_path / "checkpoints"
    args = ["--namespace", ns, "--folder", str(folder), "--tp", "2"]
    run = run_loop(SCRIPT, args, daemon.client_env, log_dir=tmp_path / "logs", timeout=240)
    assert run.returncodes == [0, 0], run
    out = json.loads(run.lines[-1])
    assert out == {
        "tracker_sync": "1",
        "tracker_async": "2",
        "loaded": 2,  # not the tracker's 5: never committed
        "exact": True,
        "loaded_step": 1,
        "exact_step": True,
        "uninstalled": True,
        # Megatron-LM's own empty folders, created before each save; no bytes in them.
        "folders": ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"],
    }
    assert not any((folder / "iter_0000002").iterdir())
    with DaemonClient.from_socket(daemon.socket) as c:
        states = {s.step: s.state for s in c.steps(ns)}
    assert states[5] == "writing" and states[1] != "writing" and states[2] != "writing", states
