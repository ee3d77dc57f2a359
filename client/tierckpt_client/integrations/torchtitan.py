"""torchtitan's checkpoint manager, saving through the node's tierckpt daemon.

torchtitan 0.3.0 has no option for a storage writer: ``CheckpointManager.dcp_save`` hands DCP a
``checkpoint_id`` folder only. Its supported seam is the manager itself: the trainer builds
whatever ``config.checkpoint`` names (``Trainer.Config.checkpoint`` is any
``BaseCheckpointManager.Config``), and ``--override.imports`` swaps one config node for another
before anything is built. So the one change a torchtitan user makes is one flag::

    torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports 'tierckpt_client.integrations.torchtitan.tiered_checkpoint={"namespace": "my-job"}'

(or ``checkpoint=TieredCheckpointManager.Config(namespace="my-job", ...)`` in a config_registry
function of one's own).

What changes, against torchtitan's own ``CheckpointManager`` (everything else is its code):

* A save of step ``N`` is step ``N`` of the namespace (``tierckpt://<namespace>/<N>``), written
  with :class:`~tierckpt_client.dcp.TieredStorageWriter` on a gloo group of its own; the folder
  ``checkpoint.folder`` is not written. ``async_mode`` keeps torchtitan's meaning; ``"async"``
  (the default here) returns once the state is staged, as torchtitan's does. The last step of
  training is saved for the persistent tier (``persist=True``); the other steps follow
  ``persist_every``.
* ``load()`` resumes from the newest step the daemon committed (this node's memory, a peer's, or
  the persistent tier), or ``checkpoint.load_step``. A namespace with no step falls back to
  torchtitan's own loading (``initial_load_path``, the HF assets, or a step folder an earlier run
  wrote without tierckpt), so a job can move to tierckpt mid-way.
* ``keep_latest_k`` deletes older steps from each node's memory tier (local rank 0 of each node
  asks its daemon); copies in the persistent tier stay, under the daemon's retention.
* A failed background save is raised by the next save (or at ``close()``) as
  :class:`SaveFailedError`, naming the step.

Not thread-safe, as torchtitan's own manager: the training loop calls it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.config.override import derive, override
from torchtitan.tools.utils import GarbageCollection

from tierckpt_client import _fresh
from tierckpt_client.checkpointer import SaveFailedError, checkpoint_groups
from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp.ids import SCHEME, format_checkpoint_id, parse_checkpoint_id
from tierckpt_core.errors import NamespaceNotFoundError, StepNotFoundError, TierCkptError
from tierckpt_core.protocol import validate_namespace

__all__ = ["SaveFailedError", "TieredCheckpointManager", "tiered_checkpoint"]

logger = logging.getLogger(__name__)


class TieredCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with tierckpt steps in place of step folders (see the
    module docstring). Built by the trainer from :class:`TieredCheckpointManager.Config`."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """``CheckpointManager.Config`` (``interval``, ``keep_latest_k``, ``load_step``, ...) and:

        Attributes:
            namespace: the job's namespace in the daemon (letters, digits, ``.``, ``_``, ``-``).
            persist_every: steps with ``step % persist_every == 0`` are saved for the persistent
                tier, the others stay in memory; ``None``: the daemon's policy
                (``TIERCKPT_PERSIST_EVERY``). The last step of training is always saved for it.
            async_mode: as torchtitan's; ``"async"`` by default here (a save returns once
                staged, the write into the daemon runs in a thread).
        """

        namespace: str = ""
        """The job's namespace in the tierckpt daemon."""

        persist_every: int | None = None
        """Save every k-th step for the persistent tier; None: the daemon's policy."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "async"
        """DCP save mode: synchronous, threaded async, or pinned-memory async."""

        def __post_init__(self) -> None:
            # Called by name: zero-argument super() does not work in a slots dataclass.
            CheckpointManager.Config.__post_init__(self)
            if not self.namespace:
                raise ValueError(
                    "TieredCheckpointManager.Config: namespace is required "
                    '(e.g. --override.imports \'...tiered_checkpoint={"namespace": "my-job"}\')'
                )
            validate_namespace(self.namespace)
            if self.persist_every is not None and self.persist_every < 1:
                raise ValueError(f"persist_every must be >= 1 or None, got {self.persist_every}")
            if self.last_save_in_hf:
                raise ValueError(
                    "TieredCheckpointManager saves DCP steps into the daemon; last_save_in_hf "
                    "(safetensors files in checkpoint.folder) is not supported"
                )

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.namespace = config.namespace
        self.persist_every = config.persist_every
        self.client_config = ClientConfig.from_env()
        # A gloo group of its own, as Checkpointer's: THREAD-mode saves run DCP's collectives in
        # a background thread, and "latest" is broadcast over it on load (NCCL needs CUDA objects).
        self._ckpt_group, _ = checkpoint_groups(None)
        self._force_persist = False
        self._inflight_step: int | None = None
        self._last_started: int | None = None  # the newest step whose save this process began
        self._folder_ids = False  # True while torchtitan's own loading runs (the fallback)

    def __repr__(self) -> str:
        return f"TieredCheckpointManager({getattr(self, 'namespace', None)!r})"

    # -- ids -------------------------------------------------------------------------------
    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        if self._folder_ids or folder:
            return str(super()._create_checkpoint_id(step, folder))
        return format_checkpoint_id(self.namespace, step)

    def _persist(self, step: int) -> bool | None:
        if self._force_persist:
            return True
        if self.persist_every is None:
            return None
        return step % self.persist_every == 0

    # -- saving ----------------------------------------------------------------------------
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # The end of training is what a restart on a new node needs: that step goes to the
        # persistent tier whatever the cadence.
        self._force_persist = last_step
        try:
            return bool(super()._save(curr_step, last_step))
        finally:
            self._force_persist = False

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Future[Any] | AsyncSaveResponse | None:
        if to_hf or not checkpoint_id.startswith(SCHEME):
            raise ValueError(
                f"{self.namespace}: TieredCheckpointManager saves only tierckpt steps, "
                f"not {checkpoint_id!r} (to_hf={to_hf})"
            )
        _, step = parse_checkpoint_id(checkpoint_id)
        assert step is not None
        writer = TieredStorageWriter(
            self.namespace, step, persist=self._persist(step), config=self.client_config
        )
        self._last_started = step
        ret: Future[Any] | AsyncSaveResponse | None
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=writer, process_group=self._ckpt_group)
            ret = None
        else:
            pinned = async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
            ret = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self._ckpt_group,
                async_checkpointer_type=(
                    AsyncCheckpointerType.PROCESS if pinned else AsyncCheckpointerType.THREAD
                ),
                async_stager=self.stager if pinned else None,
            )
            self._inflight_step = step
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _wait_for_saving(self) -> None:
        step = self._inflight_step
        self._inflight_step = None
        try:
            super()._wait_for_saving()
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            self.save_future = None
            raise SaveFailedError.of(f"{self.namespace}: the save of step {step}", e) from e

    def _close(self) -> None:
        try:
            # getattr: close() also runs from __del__, after an __init__ that may have failed.
            if getattr(self, "save_future", None) is not None:
                self._wait_for_saving()  # a save in flight finishes (or raises) before the exit
        finally:
            super()._close()

    def _should_purge(self) -> bool:
        return bool(self.keep_latest_k > 0)

    def _purge_stale_checkpoints(self) -> None:
        """Keep the newest ``keep_latest_k`` steps, the one just started included, in this
        node's daemon (local rank 0 of each node: each node has its own daemon). Only steps
        older than that one are counted: it may not be listed yet while it is written."""
        newest = self._last_started
        if not self._should_purge() or newest is None:
            return
        if int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return
        try:
            with DaemonClient(self.client_config) as client:
                older = sorted(s.step for s in client.steps(self.namespace) if s.step < newest)
                for step in older[: len(older) - (self.keep_latest_k - 1)]:
                    with contextlib.suppress(StepNotFoundError):  # the daemon's retention won
                        client.delete(self.namespace, step)
        except NamespaceNotFoundError:
            pass  # nothing committed yet
        except TierCkptError as e:
            # Training goes on, as torchtitan's purge thread goes on after a failed delete; the
            # daemon's own retention (TIERCKPT_KEEP_LAST) still bounds the memory tier.
            logger.warning("%s: could not delete old steps from the daemon: %s", self.namespace, e)

    # -- loading ---------------------------------------------------------------------------
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        wanted = None if step == -1 else step
        probe = TieredStorageReader(
            self.namespace, wanted, config=self.client_config, process_group=self._ckpt_group
        )
        try:
            probe.read_metadata()  # resolves "latest" on rank 0 and broadcasts it
        except (NamespaceNotFoundError, StepNotFoundError) as e:
            if wanted is not None:
                raise StepNotFoundError(
                    f"--checkpoint.load_step={step}: tierckpt://{self.namespace}/{step} "
                    f"does not exist ({e})"
                ) from e
            _fresh.starting_fresh(
                logger,
                self.namespace,
                e,
                self.client_config,
                what="no step in tierckpt; torchtitan's own loading decides",
            )
            with self._torchtitan_ids():
                return bool(super()._load(step))
        resolved = probe.resolved_step
        assert resolved is not None
        states = self._states_to_load(model_only=resolved == 0)
        reader = TieredStorageReader(
            self.namespace, resolved, config=self.client_config, process_group=self._ckpt_group
        )
        dcp.load(states, storage_reader=reader, process_group=self._ckpt_group)
        # The model's entries are flattened into the top level (as torchtitan saves them).
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(states)
        logger.info("%s: restored step %d", self.namespace, resolved)
        return True

    @contextlib.contextmanager
    def _torchtitan_ids(self) -> Iterator[None]:
        self._folder_ids = True
        try:
            yield
        finally:
            self._folder_ids = False


@override(
    target=CheckpointManager.Config,
    description="checkpoint through the node's tierckpt daemon",
)
def tiered_checkpoint(
    config: CheckpointManager.Config,
    *,
    namespace: str,
    persist_every: int | None = None,
    async_mode: str = "async",
    interval: int | None = None,
) -> TieredCheckpointManager.Config:
    """The ``--override.imports`` target: the run's checkpoint config, turned into a
    :class:`TieredCheckpointManager.Config` (its other settings kept) and enabled.

    Args (the JSON object after the target): ``namespace`` (required), ``persist_every``,
    ``async_mode`` (default ``"async"``), ``interval`` (default: the run's
    ``checkpoint.interval``).
    """
    deltas: dict[str, Any] = {
        "namespace": namespace,
        "persist_every": persist_every,
        "async_mode": async_mode,
        "enable": True,
    }
    if interval is not None:
        deltas["interval"] = interval
    return derive(config, TieredCheckpointManager.Config, **deltas)
