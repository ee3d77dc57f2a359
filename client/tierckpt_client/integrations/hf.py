"""Hugging Face: the ``transformers`` ``Trainer`` and ``accelerate`` loops, checkpointed through
the node's tierckpt daemon with :class:`~tierckpt_client.Checkpointer`.

Neither library has a seam for a DCP storage writer: accelerate's FSDP saves build
``FileSystemWriter`` themselves (``save_fsdp_model``/``save_fsdp_optimizer``), and the
``Trainer`` writes its checkpoints through them or through ``torch.save``. What works is to
leave their saving off and save the training state with the ``Checkpointer``:

* :class:`TrainingState` is the ``Stateful`` for that: model and optimizer through torch's
  ``get_state_dict``/``set_state_dict`` (DDP and plain modules; accelerate's wrappers are
  unwrapped), plus the LR scheduler's ``state_dict``.
* :class:`TieredCheckpointCallback` is the ``Trainer`` recipe in one line::

      trainer = Trainer(..., args=TrainingArguments(..., save_strategy="no"),
                        callbacks=[TieredCheckpointCallback("my-job", every=500)])

  It restores the newest step when training begins (weights, optimizer, scheduler and
  ``global_step``), saves on its cadence after each optimizer step, and waits for the last save
  when training ends (raising its error).

Not thread-safe: the Trainer calls the callback from its training loop.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer
from transformers import TrainerCallback

from tierckpt_client._save_loop import check_save_options
from tierckpt_client.checkpointer import Checkpointer, SaveFailedError
from tierckpt_core.protocol import validate_namespace

__all__ = ["SaveFailedError", "TieredCheckpointCallback", "TrainingState"]

logger = logging.getLogger(__name__)


def _unwrap_optimizer(optimizer: Any) -> Optimizer:
    # accelerate's AcceleratedOptimizer is an Optimizer whose state lives in ``.optimizer``. An
    # LR scheduler has an ``.optimizer`` too: it is refused, not unwrapped (in the optimizer's
    # place, the scheduler's position was lost on resume, and nothing said so).
    inner = getattr(optimizer, "optimizer", optimizer) if isinstance(optimizer, Optimizer) else None
    if not isinstance(inner, Optimizer):
        raise TypeError(
            f"expected a torch.optim.Optimizer as the optimizer, got {type(optimizer).__name__} "
            "(TrainingState(model, optimizer, lr_scheduler), in that order)"
        )
    return inner


def _check_scheduler(lr_scheduler: Any) -> Any:
    """An LR scheduler (torch's, or accelerate's wrapper of one): it has ``step`` and its own
    ``state_dict``/``load_state_dict``, and is not an optimizer."""
    if isinstance(lr_scheduler, (Optimizer, nn.Module)) or not all(
        callable(getattr(lr_scheduler, a, None)) for a in ("step", "state_dict", "load_state_dict")
    ):
        raise TypeError(
            f"expected an LR scheduler as the lr_scheduler, got {type(lr_scheduler).__name__} "
            "(TrainingState(model, optimizer, lr_scheduler), in that order)"
        )
    return lr_scheduler


class TrainingState(Stateful):
    """A model, its optimizer and LR scheduler as one ``Stateful`` for
    :class:`~tierckpt_client.Checkpointer` (``state={"train": TrainingState(model, opt)}``).

    The model may be wrapped in ``DistributedDataParallel`` (accelerate's ``prepare`` does);
    its keys are saved without the wrapper's ``module.`` prefix, so a checkpoint loads into a
    model wrapped or not, on any number of ranks.
    """

    def __init__(
        self, model: nn.Module, optimizer: Any | None = None, lr_scheduler: Any | None = None
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected an nn.Module as the model, got {type(model).__name__}")
        self.model = model
        self.optimizers = [] if optimizer is None else [_unwrap_optimizer(optimizer)]
        self.lr_scheduler = None if lr_scheduler is None else _check_scheduler(lr_scheduler)

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        sd: dict[str, Any] = {"model": model_sd}
        if self.optimizers:
            sd["optim"] = optim_sd
        if self.lr_scheduler is not None:
            sd["lr_scheduler"] = self.lr_scheduler.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optim", {}),
        )
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state_dict["lr_scheduler"])


class TieredCheckpointCallback(TrainerCallback):
    """Checkpoint a ``transformers.Trainer`` run through tierckpt (see the module docstring).

    Args:
        namespace: the job's namespace in the daemon.
        every: save after optimizer steps with ``global_step % every == 0``.
        **checkpointer_kwargs: :class:`~tierckpt_client.Checkpointer`'s other arguments
            (``persist_every``, ``async_mode``, ``config``, ``preempt_signal``, ...).

    Set ``save_strategy="no"`` in ``TrainingArguments``: the Trainer's own checkpoints are
    files in ``output_dir``, written besides these otherwise.
    """

    def __init__(self, namespace: str, *, every: int = 500, **checkpointer_kwargs: Any) -> None:
        # The Checkpointer is made when training begins: its arguments are checked here, before
        # the model and the Trainer are built (a misspelt one failed only at train time).
        inspect.signature(Checkpointer).bind(namespace, every=every, **checkpointer_kwargs)
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        check_save_options(
            checkpointer_kwargs.get("persist_every"),
            checkpointer_kwargs.get("async_mode", "thread"),
        )
        self.namespace = validate_namespace(namespace)
        self.every = every
        self._kwargs = checkpointer_kwargs
        self.checkpointer: Checkpointer | None = None
        self.restored_step: int | None = None
        self._state: dict[str, Any] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Here, not in __init__: the Trainer has initialized torch.distributed and built the
        # optimizer and scheduler by now, and every rank calls this at once.
        self.checkpointer = Checkpointer(self.namespace, every=self.every, **self._kwargs)
        self._state = {
            "train": TrainingState(
                kwargs["model"], kwargs.get("optimizer"), kwargs.get("lr_scheduler")
            )
        }
        step = self.checkpointer.restore(self._state)
        self.restored_step = step
        if step is not None:
            # The loop goes on from this step up to max_steps; its data loader starts from the
            # beginning of the epoch (the Trainer skips batches only for its own checkpoints).
            state.global_step = step
            logger.info("%s: resumed at step %d", self.namespace, step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.checkpointer is not None, "on_step_end before on_train_begin"
        self.checkpointer.save(state.global_step, self._state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()  # the last save finishes here, or raises SaveFailedError
