"""Hugging Face: a ``transformers.Trainer`` run (DDP, 2 gloo ranks on CPU, a tiny GPT-2 built from
a config) with ``TieredCheckpointCallback``, and an ``accelerate`` loop with ``Checkpointer`` and
``TrainingState``, each saving into a real daemon; a second run resumes from the newest step
left and reaches the weights of the uninterrupted run (the examples, run as a user runs them)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import accelerate  # noqa: F401  (the [hf] extra: imported, never skipped)
import pytest
import transformers  # noqa: F401

from tierckpt_client import DaemonClient
from tierckpt_client.config import ClientConfig

from helpers import DaemonProcess, run_loop

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["hf_trainer.py", "hf_accelerate.py"])
def test_resumed_run_reaches_the_weights_of_an_uninterrupted_one(
    script: str, tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """Six steps saved every third; step 6 is then lost (as if the run had died before saving
    it): the second run starts from step 3 and prints, after steps 4 to 6, the weight digests
    the first run printed."""
    node = make_node(keep_last=10)
    args = ["--namespace", "hf", "--steps", "6", "--every", "3"]
    ref = run_loop(EXAMPLES / script, args, node.client_env, log_dir=tmp_path)
    assert ref.returncodes == [0, 0], ref.lines
    assert ref.start == 0 and sorted(ref.losses) == list(range(1, 7)), ref.lines
    with DaemonClient(ClientConfig.from_env(socket=node.socket)) as c:
        assert sorted(s.step for s in c.steps("hf")) == [3, 6]
        c.delete("hf", 6)
    resumed = run_loop(EXAMPLES / script, args, node.client_env, log_dir=tmp_path)
    assert resumed.returncodes == [0, 0], resumed.lines
    assert resumed.start == 3, resumed.lines
    assert resumed.losses == {s: ref.losses[s] for s in (4, 5, 6)}
