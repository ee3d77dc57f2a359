"""torch's ``Stateful`` values of a state dict, told apart cheaply.

DCP turns each top-level value that is ``Stateful`` (has ``state_dict`` and ``load_state_dict``)
into its state dict before a save or a load, and hands a load's result back through
``load_state_dict``. ``Stateful`` is a runtime-checkable protocol: ``isinstance(v, Stateful)``
looks both methods up with ``inspect.getattr_static`` over the value's type, ~15-17 us a value
on the 2-core box, whatever the answer. A state dict of thousands of top-level tensors (a model's
``state_dict()`` passed as it is) paid ~35 ms of a save's stall for it, and ``dcp.load`` asks
twice per key. The builtin containers, scalars and plain tensors have neither method: for them
(by exact type, so a subclass that adds the methods is still asked) the answer is known.
The :class:`~tierckpt_client.Checkpointer`'s saves and loads go through here: a save's
background half too (:func:`save`), where ``dcp.save`` asked each top-level key of the staged
state dict again, each answer inside a logging wrapper made for that key.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

_NEVER = frozenset(
    {torch.Tensor, torch.nn.Parameter, dict, list, tuple, str, bytes, int, float, bool, type(None)}
)


def is_stateful(value: Any) -> bool:
    """``isinstance(value, Stateful)``, without the protocol's lookups for plain values."""
    return type(value) not in _NEVER and isinstance(value, Stateful)


def state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each ``Stateful`` value replaced by its ``state_dict()`` (what DCP saves)."""
    return {k: v.state_dict() if is_stateful(v) else v for k, v in state.items()}


def load(
    state: dict[str, Any],
    *,
    storage_reader: StorageReader,
    process_group: dist.ProcessGroup | None,
    no_dist: bool,
    planner: LoadPlanner | None = None,
    loader: Callable[..., None] | None = None,
) -> None:
    """``dcp.load(state, storage_reader=..., process_group=..., no_dist=..., planner=...)``, with the same
    handling of ``Stateful`` values (their ``state_dict()`` loaded into, then handed to their
    ``load_state_dict``; other values replaced by what was loaded) but the protocol test skipped
    for plain values (see the module). DCP's own ``load`` is this around its
    ``_load_state_dict``; where torch lacks that function as expected, ``dcp.load`` runs.
    ``loader``: a function with ``_load_state_dict``'s parameters to run instead of it (the
    Checkpointer's, :mod:`tierckpt_client._local_load`)."""
    inner = loader or _inner(state_dict_loader, "_load_state_dict", "storage_reader")
    if inner is None:
        dcp.load(
            state,
            storage_reader=storage_reader,
            process_group=process_group,
            no_dist=no_dist,
            planner=planner,
        )
        return
    no_dist = no_dist or not dist.is_available() or not dist.is_initialized()
    keys = sorted(state)  # every rank loads the keys in the same order, as DCP does
    stateful = {k for k in keys if is_stateful(state[k])}
    loaded = {k: state[k].state_dict() if k in stateful else state[k] for k in keys}
    inner(
        state_dict=loaded,
        storage_reader=storage_reader,
        process_group=process_group,
        no_dist=no_dist,
        planner=planner,
    )
    for k in keys:
        if k in stateful:
            state[k].load_state_dict(loaded[k])
        else:
            state[k] = loaded[k]


def save(
    state: dict[str, Any],
    *,
    storage_writer: StorageWriter,
    process_group: dist.ProcessGroup | None,
    no_dist: bool,
    planner: SavePlanner | None = None,
) -> Any:
    """``dcp.save(state, storage_writer=..., process_group=..., no_dist=..., planner=...)``: each
    ``Stateful`` value saved as its ``state_dict()``, the protocol test skipped for plain values
    (see the module). DCP's own ``save`` is this around its ``_save_state_dict``, with a logging
    wrapper made for each top-level key (with the test, ~65 us a key on the 2-core box: 135 ms
    of the background of a save of 2048 top-level tensors); where torch lacks that function as
    expected, ``dcp.save`` runs. DCP's metadata, as ``dcp.save``'s."""
    inner = _inner(state_dict_saver, "_save_state_dict", "storage_writer")
    if inner is None:
        return dcp.save(
            state,
            storage_writer=storage_writer,
            process_group=process_group,
            no_dist=no_dist,
            planner=planner,
        )
    return inner(
        state_dict=state_dicts(state),
        storage_writer=storage_writer,
        process_group=process_group,
        no_dist=no_dist or not dist.is_available() or not dist.is_initialized(),
        planner=planner,
    )


_EXPECTED = {"state_dict", "process_group", "no_dist", "planner"}


@functools.cache
def _inner(module: Any, name: str, storage: str) -> Callable[..., Any] | None:
    """DCP's ``module.name`` where it takes the parameters :func:`load` and :func:`save` pass
    (``storage``: the reader's or the writer's), else None."""
    fn = getattr(module, name, None)
    if fn is None:
        return None
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return fn if params >= _EXPECTED | {storage} else None
