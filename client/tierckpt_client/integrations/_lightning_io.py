"""``TieredCheckpointIO``: Lightning's ``CheckpointIO`` plugin for the strategies that use one
(``DDPStrategy``, single device), saving into the node's tierckpt daemon.

Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only, with the
whole (unsharded) checkpoint, and ``load_checkpoint`` on every rank. So a save is a one-process
``dcp.async_save`` (``no_dist``) by rank 0: every tensor of the checkpoint as its own DCP item,
and the rest of the dict (with the tensors taken out) serialized by ``torch.save`` as Lightning's
own files are, in one uint8 tensor. A load reads every item back without a template
(``_load_state_dict_from_keys``) and puts the tensors back in their places. Paths map to steps
with pointer files as for the strategies (see :mod:`tierckpt_client.integrations.lightning`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

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
from tierckpt_client.dcp.ids import SCHEME, parse_checkpoint_id
from tierckpt_client.integrations._pointers import (
    pointer_id,
    read_pointer,
    warn_other_namespace,
    write_pointer,
)
from tierckpt_core.errors import StepNotFoundError, TierCkptError
from tierckpt_core.protocol import validate_namespace

logger = logging.getLogger(__name__)

_META = "lightning"  # the checkpoint without its tensors, as the bytes of torch.save
_TENSOR = "tensor."  # DCP keys of the tensors taken out: tensor.0, tensor.1, ...
_HOLE = "\0tierckpt-tensor:"  # what stands in a tensor's place in the pickled rest: a string,
# so that a ``weights_only=True`` load of the rest needs nothing beyond what Lightning's needs


def _take_tensors(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by a placeholder naming its index in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return f"{_HOLE}{len(tensors) - 1}"
    if isinstance(obj, dict):
        items = [(k, _take_tensors(v, tensors)) for k, v in obj.items()]
        try:
            return type(obj)(items)
        except TypeError:  # a dict subclass that cannot be built from pairs
            return dict(items)
    if isinstance(obj, list):
        return [_take_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):  # namedtuples stay as they are
        return tuple(_take_tensors(v, tensors) for v in obj)
    return obj


def _put_tensors(obj: Any, tensors: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, str) and obj.startswith(_HOLE):
        return tensors[int(obj[len(_HOLE) :])]
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _put_tensors(v, tensors)
        return obj
    if isinstance(obj, list):
        return [_put_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_put_tensors(v, tensors) for v in obj)
    return obj


class TieredCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` for ``DDPStrategy`` and single-device training, saving into
    the node's tierckpt daemon: ``L.Trainer(strategy="ddp", plugins=[TieredCheckpointIO("job")])``.

    Args as :class:`~tierckpt_client.integrations.lightning.TieredModelParallelStrategy`'s
    (``namespace``, ``persist_every``, ``config``, ``async_mode``). Saves are asynchronous, one
    in flight, their error raised by the next save or when ``fit`` ends, as for the strategies.
    """

    def __init__(
        self,
        namespace: str,
        *,
        persist_every: int | None = None,
        config: ClientConfig | None = None,
        async_mode: str = "thread",
    ) -> None:
        check_save_options(persist_every, async_mode)
        self.namespace = validate_namespace(namespace)
        self.persist_every = persist_every
        self.async_mode = async_mode
        self._config = config
        self._inflight = SaveInFlight(self.namespace)
        self._last_step: int | None = None
        self._pointers: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"TieredCheckpointIO({self.namespace!r})"

    @property
    def config(self) -> ClientConfig:
        if self._config is None:  # read when first used: the ranks' environment
            self._config = ClientConfig.from_env()
        return self._config

    # -- saving (global rank 0) ------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("TieredCheckpointIO.save_checkpoint takes no storage_options")
        target = os.fspath(path)
        pointer: Path | None = None
        if target.startswith(SCHEME):
            namespace, step = parse_checkpoint_id(target)
            if namespace != self.namespace or step is None:
                raise ValueError(
                    f"save_checkpoint({target!r}): a save names a step of this plugin's "
                    f"namespace, tierckpt://{self.namespace}/<step>"
                )
        else:
            step, pointer = int(checkpoint["global_step"]), Path(target)
        if step != self._last_step:
            self._start(step, checkpoint)
        if pointer is not None:
            checkpoint_id = pointer_id(self.namespace, pointer, step)
            self._pointers[os.path.normpath(pointer)] = checkpoint_id
            write_pointer(pointer, checkpoint_id)

    def _start(self, step: int, checkpoint: dict[str, Any]) -> None:
        self.wait()
        tensors: list[torch.Tensor] = []
        rest = _take_tensors(checkpoint, tensors)
        state: dict[str, Any] = {f"{_TENSOR}{i}": t for i, t in enumerate(tensors)}
        buf = io.BytesIO()
        torch.save(rest, buf)
        state[_META] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        persist = None if self.persist_every is None else step % self.persist_every == 0
        writer = TieredStorageWriter(self.namespace, step, persist=persist, config=self.config)
        with warnings.catch_warnings():
            # DCP warns that a no_dist save runs in one process: here that is the point.
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            result = dcp.async_save(
                state,
                storage_writer=writer,
                async_checkpointer_type=ASYNC_MODES[self.async_mode],
                no_dist=True,  # rank 0 alone holds (and saves) the whole checkpoint
            )
        self._inflight.start(step, result)
        self._last_step = step

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise :class:`SaveFailedError` if it failed."""
        self._inflight.wait()

    def teardown(self) -> None:
        # Lightning calls this from an ``except`` block when fit fails: the save's error is then
        # logged, not raised over the one that is unwinding.
        if sys.exc_info()[1] is None:
            self.wait()
            return
        try:
            self.wait()
        except SaveFailedError:
            logger.exception("%s: the last save failed while another error unwound", self)

    # -- loading (every rank) --------------------------------------------------------------
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        text = os.fspath(path)
        checkpoint_id = text if text.startswith(SCHEME) else read_pointer(text)
        if checkpoint_id is None:  # a checkpoint written without tierckpt
            return TorchCheckpointIO().load_checkpoint(path, map_location, weights_only)
        if checkpoint_id != text:
            warn_other_namespace(self.namespace, text, checkpoint_id)
        namespace, step = parse_checkpoint_id(checkpoint_id)
        # Verified whatever TIERCKPT_VERIFY_READS says: _META is unpickled.
        reader = TieredStorageReader(namespace, step, config=self.config.verifying())
        group, _ = checkpoint_groups(
            None
        )  # a gloo group when the job is distributed (may train on NCCL)
        with warnings.catch_warnings():
            # One process without torch.distributed (single device): DCP says it loads alone.
            warnings.filterwarnings("ignore", "torch.distributed is unavailable or uninitialized")
            state = _load_state_dict_from_keys(storage_reader=reader, process_group=group)
        if _META not in state:
            raise ValueError(
                f"{checkpoint_id} was not saved by TieredCheckpointIO (it has no {_META!r} "
                "entry); load it with TieredStorageReader instead"
            )
        rest = torch.load(
            io.BytesIO(state.pop(_META).numpy().tobytes()),
            map_location=map_location,
            weights_only=weights_only,
        )
        tensors = {int(k[len(_TENSOR) :]): v for k, v in state.items() if k.startswith(_TENSOR)}
        if map_location is not None:
            tensors = {i: t.to(map_location) for i, t in tensors.items()}
        loaded: dict[str, Any] = _put_tensors(rest, tensors)
        self._last_step = reader.resolved_step
        logger.info("%s: restored step %s", namespace, reader.resolved_step)
        return loaded

    # -- removing (global rank 0) ----------------------------------------------------------
    def remove_checkpoint(self, path: _PATH) -> None:
        key = os.path.normpath(path)
        checkpoint_id = self._pointers.pop(key, None) or read_pointer(path)
        if checkpoint_id is None:
            TorchCheckpointIO().remove_checkpoint(path)
            return
        with contextlib.suppress(FileNotFoundError):
            Path(path).unlink()
        namespace, step = parse_checkpoint_id(checkpoint_id)
        if step is None or namespace != self.namespace:
            return  # "latest" pointers name no step of their own
        if checkpoint_id in self._pointers.values() or any(
            read_pointer(p) == checkpoint_id for p in Path(path).parent.glob("*.ckpt")
        ):
            return  # another pointer still names it
        if self._inflight.step == step:
            self.wait()
        try:
            with DaemonClient(self.config) as client:
                client.delete(namespace, step)
        except StepNotFoundError:
            pass
        except TierCkptError as e:
            logger.warning("%s: could not delete step %d from the daemon: %s", namespace, step, e)
