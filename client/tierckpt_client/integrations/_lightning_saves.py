"""The save, load and remove logic the Lightning strategies share (:class:`_TieredSaves`, a
mixin ahead of Lightning's strategy in the MRO): a save is ``dcp.async_save`` of the sharded model
and optimizers plus Lightning's own state, a pointer file names its step, a removal deletes the
step, and a SIGTERM makes the last step durable. How paths map to steps:
:mod:`tierckpt_client.integrations.lightning`, whose strategies call these from their hooks.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from tierckpt_client import _load_plan
from tierckpt_client._preemption import Outcome, wait_durable
from tierckpt_client.checkpointer import (
    ASYNC_MODES,
    SaveFailedError,
    SaveInFlight,
    check_save_options,
    checkpoint_groups,
)
from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp.ids import SCHEME, format_checkpoint_id, parse_checkpoint_id
from tierckpt_client.integrations._pointers import (
    pointer_id,
    read_pointer,
    warn_other_namespace,
    write_pointer,
)
from tierckpt_core.errors import NamespaceNotFoundError, StepNotFoundError, TierCkptError
from tierckpt_core.protocol import validate_namespace

logger = logging.getLogger(__name__)

_META = "lightning"  # Lightning's non-tensor state, as the bytes of torch.save, in a uint8 tensor


class _TieredSaves:
    """The save/load/remove logic shared by the strategies of
    :mod:`~tierckpt_client.integrations.lightning` (a mixin ahead of Lightning's strategy in the
    MRO). Not thread-safe: Lightning calls these from the training thread."""

    # Provided by Lightning's ParallelStrategy.
    global_rank: int
    local_rank: int
    model: Any
    optimizers: list[Any]
    lightning_module: Any
    broadcast: Any

    def _tiered_init(
        self,
        namespace: str,
        persist_every: int | None,
        config: ClientConfig | None,
        async_mode: str,
        preempt_deadline_s: float,
    ) -> None:
        if preempt_deadline_s <= 0:
            raise ValueError(f"preempt_deadline_s must be > 0, got {preempt_deadline_s}")
        check_save_options(persist_every, async_mode)
        self.namespace = validate_namespace(namespace)
        self.persist_every = persist_every
        self.async_mode = async_mode
        self._config = config
        self.preempt_deadline_s = preempt_deadline_s
        self._ckpt_group: dist.ProcessGroup | None = None
        self._flag_group: dist.ProcessGroup | None = None
        self._force_persist = False  # the save at SIGTERM goes to the persistent tier
        self._inflight = SaveInFlight(self.namespace)
        self._last_step: int | None = None  # the newest step whose save this process started
        # The pointers this process saved, path -> id: every rank knows what a removal names
        # without reading a file that another node may already have removed from a shared folder.
        self._pointers: dict[str, str] = {}
        self._unwinding = False

    @property
    def config(self) -> ClientConfig:
        if self._config is None:  # read when first used: the ranks' environment, not the parent's
            self._config = ClientConfig.from_env()
        return self._config

    def _tiered_setup_groups(self) -> None:
        # A gloo group of its own: a THREAD-mode save runs DCP's collectives in a background
        # thread; sharing the group FSDP trains on would interleave them with the training's.
        self._ckpt_group, self._flag_group = checkpoint_groups(None)

    # -- ids -------------------------------------------------------------------------------
    def _persist(self, step: int) -> bool | None:
        if self._force_persist:
            return True
        if self.persist_every is None:
            return None  # the daemon's policy (TIERCKPT_PERSIST_EVERY)
        return step % self.persist_every == 0

    def _pointer_id(self, path: Path, step: int) -> str:
        return pointer_id(self.namespace, path, step)

    # -- saving ----------------------------------------------------------------------------
    def _tiered_save(self, checkpoint: dict[str, Any], filepath: _PATH, model_key: str) -> None:
        target = self.broadcast(os.fspath(filepath))  # every rank names the same checkpoint
        if target.startswith(SCHEME):
            namespace, step = parse_checkpoint_id(target)
            if namespace != self.namespace or step is None:
                raise ValueError(
                    f"save_checkpoint({target!r}): a save names a step of this strategy's "
                    f"namespace, tierckpt://{self.namespace}/<step>"
                )
            pointer = None
        else:
            step, pointer = int(checkpoint["global_step"]), Path(target)
        if step != self._last_step:
            # Two ModelCheckpoint saves at one step (top-k and last) hold the same training
            # state: it is saved once, and both pointers name it.
            self._start_save(step, checkpoint, model_key)
        if pointer is not None:
            checkpoint_id = self._pointer_id(pointer, step)
            self._pointers[os.path.normpath(pointer)] = checkpoint_id
            if self.local_rank == 0:
                write_pointer(pointer, checkpoint_id)

    def _start_save(self, step: int, checkpoint: dict[str, Any], model_key: str) -> None:
        self.wait()
        state: dict[str, Any] = {model_key: checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{idx}"] = optim_state
        if self.global_rank == 0:
            # Rank 0's, as Lightning's own sharded save writes only rank 0's meta.pt: a tensor
            # every rank offered would have to be the same size on all of them.
            buf = io.BytesIO()
            torch.save(checkpoint, buf)
            state[_META] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        writer = TieredStorageWriter(
            self.namespace, step, persist=self._persist(step), config=self.config
        )
        result = dcp.async_save(
            state,
            storage_writer=writer,
            process_group=self._ckpt_group,
            async_checkpointer_type=ASYNC_MODES[self.async_mode],
        )
        self._inflight.start(step, result)
        self._last_step = step

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise :class:`SaveFailedError` if it failed."""
        self._inflight.wait()

    def _tiered_teardown(self) -> None:
        if self._unwinding:
            # fit is already failing: let the save finish, but do not mask the error with its own.
            try:
                self.wait()
            except SaveFailedError:
                logger.exception("%s: the last save failed while another error unwound", self)
        else:
            self.wait()

    # -- loading ---------------------------------------------------------------------------
    def _resolve(self, checkpoint_path: _PATH) -> str | None:
        """The tierckpt id ``checkpoint_path`` means (rank 0 decides), or None for a plain
        Lightning checkpoint."""
        target = None
        if self.global_rank == 0:
            text = os.fspath(checkpoint_path)
            target = text if text.startswith(SCHEME) else read_pointer(text)
            if target is not None and target != text:
                warn_other_namespace(self.namespace, text, target)
        resolved: str | None = self.broadcast(target)
        return resolved

    def _tiered_load(self, checkpoint_id: str, weights_only: bool | None) -> dict[str, Any]:
        namespace, step = parse_checkpoint_id(checkpoint_id)
        probe = TieredStorageReader(
            namespace, step, config=self.config, process_group=self._ckpt_group
        )
        try:
            metadata = probe.read_metadata()  # resolves "latest" on rank 0 and broadcasts it
        except (NamespaceNotFoundError, StepNotFoundError) as e:
            raise StepNotFoundError(
                f"{checkpoint_id}: nothing to resume from ({e}); check the namespace, or start "
                "without ckpt_path"
            ) from e
        step = probe.resolved_step
        assert step is not None
        meta_md = metadata.state_dict_metadata.get(_META)
        if not isinstance(meta_md, TensorStorageMetadata):
            raise ValueError(
                f"tierckpt://{namespace}/{step} was not saved by a Lightning strategy (it has no "
                f"{_META!r} entry); load it with TieredStorageReader instead"
            )
        model = self.model
        state: dict[str, Any] = {
            self._model_key: get_model_state_dict(model),
            _META: torch.empty(meta_md.size, dtype=torch.uint8),
        }
        optimizers = self._optimizers_to_load()
        for idx, optim in enumerate(optimizers):
            state[f"optimizer_{idx}"] = get_optimizer_state_dict(model, optim)
        # Verified whatever TIERCKPT_VERIFY_READS says: _META is unpickled.
        reader = TieredStorageReader(
            namespace, step, config=self.config.verifying(), process_group=self._ckpt_group
        )
        # The Checkpointer's load plan: an FSDP2 resume on its mesh without DCP's per-tensor
        # planning (anything else is planned by DCP as before).
        planner = _load_plan.LoadPlanner()
        dcp.load(state, storage_reader=reader, process_group=self._ckpt_group, planner=planner)
        model.load_state_dict(state[self._model_key], strict=self.lightning_module.strict_loading)
        for idx, optim in enumerate(optimizers):
            set_optimizer_state_dict(
                model,
                optim,
                optim_state_dict=state[f"optimizer_{idx}"],
                options=StateDictOptions(cpu_offload=True),
            )
        raw = state[_META].numpy().tobytes()
        loaded: dict[str, Any] = torch.load(io.BytesIO(raw), weights_only=weights_only)
        self._last_step = step
        logger.info("%s: restored step %d", namespace, step)
        return loaded

    _model_key = "state_dict"

    def _optimizers_to_load(self) -> list[Any]:
        from lightning.pytorch.trainer.states import TrainerFn

        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return []
        return list(self.optimizers)

    # -- removing --------------------------------------------------------------------------
    def _tiered_remove(self, filepath: _PATH) -> bool:
        """Remove a pointer and the step it names; False if ``filepath`` is not a pointer."""
        path = Path(filepath)
        key = os.path.normpath(path)
        checkpoint_id = self._pointers.pop(key, None) or read_pointer(path)
        if checkpoint_id is None:
            return False
        if self.local_rank != 0:
            return True  # each node's local rank 0 handles its node's file and daemon
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        namespace, step = parse_checkpoint_id(checkpoint_id)
        if step is None or namespace != self.namespace:
            return True  # "latest" pointers name no step of their own
        if checkpoint_id in self._pointers.values() or any(
            read_pointer(p) == checkpoint_id for p in path.parent.glob("*.ckpt")
        ):
            return True  # another pointer (e.g. last.ckpt of a save_last="link") still names it
        if self._inflight.step == step:
            self.wait()
        try:
            with DaemonClient(self.config) as client:
                client.delete(namespace, step)
        except StepNotFoundError:
            pass  # already gone (the daemon's retention, or it never reached this node)
        except TierCkptError as e:
            # The step stays until the daemon's own retention (keep_last) drops it; training
            # goes on, as it would if Lightning could not delete a checkpoint file.
            logger.warning("%s: could not delete step %d from the daemon: %s", namespace, step, e)
        return True

    def _tiered_exception(self, exception: BaseException) -> None:
        self._unwinding = True
        if isinstance(exception, SIGTERMException):
            self._save_durable()

    def _save_durable(self) -> None:
        """Lightning stopped fit on SIGTERM (every rank raises ``SIGTERMException`` after the
        same step): save that step unless it is saved, and wait until it is durable (within
        ``preempt_deadline_s``), so that the restart loses nothing even on a new node."""
        trainer = self.lightning_module.trainer
        step = trainer.global_step
        logger.warning("%s: SIGTERM; saving step %d for the persistent tier", self.namespace, step)
        try:
            self.wait()
        except SaveFailedError:
            logger.exception("%s: the save before SIGTERM failed", self.namespace)
        try:
            if self._last_step != step:
                self._force_persist = True
                try:
                    trainer.save_checkpoint(format_checkpoint_id(self.namespace, step))
                finally:
                    self._force_persist = False
                self.wait()
            outcome = wait_durable(
                self.namespace, step, self.config, self.preempt_deadline_s, self._flag_group
            )
        except Exception:
            logger.exception("%s: the save at SIGTERM (step %d) failed", self.namespace, step)
            return
        if outcome == Outcome.FAILED:
            logger.error("%s: step %d is not durable after SIGTERM", self.namespace, step)
        else:
            logger.warning("%s: step %d saved at SIGTERM (%s)", self.namespace, step, outcome.name)
