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
    # Every step changes the weights: else the resume's digests would match whatever it loaded
    # (accelerate's scheduler once reached a rate of 0 half-way on 2 processes).
    assert len(set(ref.losses.values())) == 6, ref.losses
    with DaemonClient(ClientConfig.from_env(socket=node.socket)) as c:
        assert sorted(s.step for s in c.steps("hf")) == [3, 6]
        c.delete("hf", 6)
    resumed = run_loop(EXAMPLES / script, args, node.client_env, log_dir=tmp_path)
    assert resumed.returncodes == [0, 0], resumed.lines
    assert resumed.start == 3, resumed.lines
    assert resumed.losses == {s: ref.losses[s] for s in (4, 5, 6)}


def test_training_state_refuses_its_parts_in_the_wrong_places() -> None:
    """The optimizer and the scheduler swapped were accepted (a scheduler has an ``.optimizer``
    too): the resume then lost the scheduler's position without a word."""
    import torch

    from tierckpt_client.integrations.hf import TrainingState

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    TrainingState(model, opt, sched)  # the right order
    for args, what in [
        ((model, sched, opt), "an optimizer as the optimizer, got StepLR"),
        ((model, sched), "an optimizer as the optimizer, got StepLR"),
        ((model, opt, opt), "an LR scheduler as the lr_scheduler, got SGD"),
        ((model, opt, model), "an LR scheduler as the lr_scheduler, got Linear"),
        ((opt, opt), "an nn.Module as the model, got SGD"),
    ]:
        with pytest.raises(
            TypeError, match=what.replace("an optimizer", "a torch.optim.Optimizer")
        ):
            TrainingState(*args)


def test_the_callback_checks_its_arguments_when_it_is_made() -> None:
    """They went to the Checkpointer only when training began, after the model was built."""
    from tierckpt_client.integrations.hf import TieredCheckpointCallback

    with pytest.raises(TypeError, match="evry"):
        TieredCheckpointCallback("ns", evry=2)
    with pytest.raises(ValueError, match="every must be >= 1"):
        TieredCheckpointCallback("ns", every=0)
    with pytest.raises(ValueError, match="persist_every"):
        TieredCheckpointCallback("ns", persist_every=0)
    with pytest.raises(ValueError, match="my job"):
        TieredCheckpointCallback("my job")
    TieredCheckpointCallback("ns", every=2, persist_every=4)
