"""torch's ``Stateful`` values of a state dict, told apart cheaply.

DCP turns each top-level value that is ``Stateful`` (has ``state_dict`` and ``load_state_dict``)
into its state dict before a save or a load, and hands a load's result back through
``load_state_dict``. ``Stateful`` is a runtime-checkable protocol: ``isinstance(v, Stateful)``
looks both methods up with ``inspect.getattr_static`` over the value's type, ~15-17 us a value
on the 2-core box, whatever the answer. A state dict of thousands of top-level tensors (a model's
``state_dict()`` passed as it is) paid ~35 ms of a save's stall for it, and ``dcp.load`` asks
twice per key. The builtin containers, scalars and plain tensors have neither method: for them
(by exact type, so a subclass that adds the methods is still asked) the answer is known.
The :class:`~tierckpt_client.Checkpointer`'s saves and loads go through here.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_loader
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader

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
) -> None:
    """``dcp.load(state, storage_reader=..., process_group=..., no_dist=..., planner=...)``, with the same
    handling of ``Stateful`` values (their ``state_dict()`` loaded into, then handed to their
    ``load_state_dict``; other values replaced by what was loaded) but the protocol test skipped
    for plain values (see the module). DCP's own ``load`` is this around its
    ``_load_state_dict``; where torch lacks that function as expected, ``dcp.load`` runs."""
    inner = _inner_load()
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


_EXPECTED = {"state_dict", "storage_reader", "process_group", "no_dist", "planner"}


@functools.cache
def _inner_load() -> Callable[..., None] | None:
    fn = getattr(state_dict_loader, "_load_state_dict", None)
    if fn is None:
        return None
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return fn if params >= _EXPECTED else None
