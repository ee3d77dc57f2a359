"""PyTorch Lightning strategies that checkpoint through the node's tierckpt daemon.

One line changes in a Lightning script::

    trainer = L.Trainer(strategy=TieredModelParallelStrategy("my-job", data_parallel_size=2), ...)
    trainer = L.Trainer(strategy="ddp", plugins=[TieredCheckpointIO("my-job")], ...)  # DDP

Lightning's sharded strategies (``ModelParallelStrategy``, ``FSDPStrategy`` with
``state_dict_type="sharded"``) do not use the ``CheckpointIO`` plugin: they write their shards in
``save_checkpoint``/``load_checkpoint``/``remove_checkpoint``. Those three are overridden here.

How Lightning's paths map to tierckpt steps (the seam, chosen so that ``ModelCheckpoint`` and
``ckpt_path="last"`` keep working unchanged):

* A save is ``dcp.async_save`` of the sharded model and optimizers, plus Lightning's own state
  (loops, callbacks, hyper-parameters; pickled by ``torch.save`` as Lightning does), into step
  ``trainer.global_step`` of the namespace. It returns once the state is in the node's memory tier;
  one save is in flight at a time, and its error is raised by the next save or at the end of
  ``fit`` (:meth:`teardown`), never dropped.
* The path ``ModelCheckpoint`` chose (``.../epoch=0-step=40.ckpt``) becomes a *pointer file*: one
  line, ``tierckpt://<namespace>/<step>``, written by local rank 0 of each node. ``last*.ckpt``
  pointers say ``tierckpt://<namespace>`` ("latest"): resuming from one loads the newest step
  the daemon committed, which is the one a crashed run got to. Lightning's ``ckpt_path="last"``
  finds these files as it finds its own.
* ``ckpt_path`` may also be an id, ``tierckpt://<namespace>/<step>`` or ``tierckpt://<namespace>``
  (newest step), with no file at all; any other path is loaded as Lightning would load it (so a
  run can start from a checkpoint written without tierckpt).
* On SIGTERM Lightning stops ``fit`` after the step it is in; the strategies then make that step
  durable in the persistent tier before the process exits (``_TieredSaves._save_durable`` in
  :mod:`tierckpt_client.integrations._lightning_saves`).
* ``save_top_k`` removals delete the pointer file and the step from each node's memory tier (a
  copy already in the persistent tier stays; its retention is the daemon's), unless another
  pointer in the same folder still names that step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from tierckpt_client.checkpointer import SaveFailedError
from tierckpt_client.config import ClientConfig
from tierckpt_client.integrations._lightning_io import TieredCheckpointIO
from tierckpt_client.integrations._lightning_saves import _TieredSaves
from tierckpt_client.integrations._pointers import read_pointer

__all__ = [
    "SaveFailedError",
    "TieredCheckpointIO",
    "TieredFSDPStrategy",
    "TieredModelParallelStrategy",
    "read_pointer",
]


if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy as _Strategy
else:
    _Strategy = object


class _TieredStrategy(_TieredSaves, _Strategy):
    """Lightning's checkpoint hooks of a strategy, through :class:`_TieredSaves` (ahead of
    Lightning's own strategy in the MRO: ``super()`` is Lightning's)."""

    _model_key = "state_dict"  # the key of the model in the checkpoint Lightning hands a save

    def setup_environment(self) -> None:
        super().setup_environment()
        self._tiered_setup_groups()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        self._tiered_save(checkpoint, filepath, self._model_key)

    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        checkpoint_id = self._resolve(checkpoint_path)
        if checkpoint_id is None:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        return self._tiered_load(checkpoint_id, weights_only)

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if not self._tiered_remove(filepath):
            super().remove_checkpoint(filepath)

    def on_exception(self, exception: BaseException) -> None:
        self._tiered_exception(exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        try:
            self._tiered_teardown()
        finally:
            super().teardown()


class TieredModelParallelStrategy(_TieredStrategy, ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallel), checkpointing through
    the node's tierckpt daemon (see the module docstring for how paths map to steps).

    Args:
        namespace: the job's namespace (letters, digits, ``.``, ``_``, ``-``).
        persist_every: steps with ``global_step % persist_every == 0`` are saved with
            ``persist=True`` (the daemon uploads them to the persistent tier), the others with
            ``persist=False``; ``None`` leaves every step to the daemon's policy.
        config: how to reach the daemon (default :meth:`ClientConfig.from_env`, read in each rank).
        async_mode: ``"thread"`` or ``"process"`` (DCP's helper process), as for ``Checkpointer``.
        preempt_deadline_s: on SIGTERM (Lightning stops ``fit`` after the step it is in), how long
            the last step may take to become durable in the persistent tier.
        **kwargs: ``ModelParallelStrategy``'s own arguments (``data_parallel_size``,
            ``tensor_parallel_size``, ``process_group_backend``, ``timeout``).
    """

    def __init__(
        self,
        namespace: str,
        *,
        persist_every: int | None = None,
        config: ClientConfig | None = None,
        async_mode: str = "thread",
        preempt_deadline_s: float = 300.0,
        **kwargs: Any,
    ) -> None:
        if not kwargs.get("save_distributed_checkpoint", True):
            raise ValueError(
                "TieredModelParallelStrategy saves sharded checkpoints; "
                "save_distributed_checkpoint=False (one full file on rank 0) is not supported"
            )
        ModelParallelStrategy.__init__(self, **kwargs)
        self._tiered_init(namespace, persist_every, config, async_mode, preempt_deadline_s)

    def __repr__(self) -> str:
        return f"TieredModelParallelStrategy({self.namespace!r})"


class TieredFSDPStrategy(_TieredStrategy, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1; Lightning runs it on GPUs only), checkpointing
    through the node's tierckpt daemon. Arguments as :class:`TieredModelParallelStrategy`, with
    ``FSDPStrategy``'s own in ``**kwargs``; ``state_dict_type`` is ``"sharded"`` (the default
    here), a ``"full"`` one is refused."""

    _model_key = "model"  # the key Lightning's FSDPStrategy gives the model in sharded saves

    def __init__(
        self,
        namespace: str,
        *,
        persist_every: int | None = None,
        config: ClientConfig | None = None,
        async_mode: str = "thread",
        preempt_deadline_s: float = 300.0,
        **kwargs: Any,
    ) -> None:
        kind = kwargs.setdefault("state_dict_type", "sharded")
        if kind != "sharded":
            raise ValueError(
                f"TieredFSDPStrategy saves sharded checkpoints; state_dict_type={kind!r} "
                "is not supported"
            )
        FSDPStrategy.__init__(self, **kwargs)
        self._tiered_init(namespace, persist_every, config, async_mode, preempt_deadline_s)

    def __repr__(self) -> str:
        return f"TieredFSDPStrategy({self.namespace!r})"
