"""The write items of a save's ``DTensor`` values, made without DCP's per-tensor work.

DCP's default save planner asks each ``DTensor`` for its write item: the DTensor works out its
local chunk (``compute_local_shape_and_global_offset``) and its properties from ``to_local()``
(an autograd call outside ``no_grad``), ~0.5-1.5 ms a ``DTensor`` on the 2-core box, so an FSDP2
state of 2048 parameters spent 1-2 s of every save's background in planning, holding the GIL
beside the trainer. The chunk depends only on the global shape, the mesh and the placements, and
the tensors of a model share a few shapes: :func:`with_known_items` asks the first ``DTensor`` of
each shape, mesh and placements for its item as DCP does and makes the others' from it (the
chunk's offsets and sizes; each tensor's own key, size and properties), equal field by field
(tested).

DCP then plans as always (its plan caching included) over a state dict whose ``DTensor``
values are stood in for by :class:`_Known`: an object with DCP's own hook for objects that make
their own write items (``__create_write_items__``, the one ``DTensor`` itself implements),
which hands DCP the item made here. Only the planning sees the stand-ins; everything after it
(resolving an item to its data) sees the state dict itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from tierckpt_client._shards import plain_shard


class _Known:
    """A ``DTensor`` of the state dict, for DCP's local planning: its write item, made here."""

    __slots__ = ("items",)

    def __init__(self, item: WriteItem) -> None:
        self.items = [item]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return self.items


def with_known_items(state_dict: Mapping[str, Any]) -> dict[str, Any] | None:
    """``state_dict`` (flattened) with each plain ``DTensor`` of this rank's mesh replaced by a
    :class:`_Known` holding its write item; None when it has none (nothing to gain)."""
    chunks: dict[tuple[Any, ...], ChunkStorageMetadata | None] = {}
    grad = torch.is_grad_enabled()  # (DCP takes the properties from to_local(): see _item)
    out: dict[str, Any] = {}
    known = 0
    for fqn, obj in state_dict.items():
        if plain_shard(obj) is not None:
            item = _item(fqn, obj, chunks, grad)
            if item is not None:
                out[fqn] = _Known(item)
                known += 1
                continue
        out[fqn] = obj
    return out if known else None


def _item(
    fqn: str,
    obj: DTensor,
    chunks: dict[tuple[Any, ...], ChunkStorageMetadata | None],
    grad: bool,
) -> WriteItem | None:
    """``obj``'s write item as DCP makes it; None where DCP makes it otherwise (a rank outside
    the mesh makes none, a placement DCP refuses raises there)."""
    size = obj.size()
    key = (size, obj.device_mesh, obj.placements)
    if key in chunks:
        chunk = chunks[key]
    else:
        chunk = None
        if obj.device_mesh.get_coordinate() is not None:
            theirs = obj.__create_write_items__(fqn, obj)
            if len(theirs) == 1 and theirs[0].tensor_data is not None:
                chunk = theirs[0].tensor_data.chunk
        chunks[key] = chunk
    if chunk is None:
        return None
    local = obj._local_tensor
    properties = TensorProperties(
        dtype=local.dtype,
        layout=local.layout,
        # to_local() outside no_grad is an autograd call: its result requires grad as the
        # DTensor does; inside, it is the local tensor itself.
        requires_grad=obj.requires_grad if grad else local.requires_grad,
        memory_format=torch.contiguous_format,
        pin_memory=local.is_pinned(),
    )
    mine = ChunkStorageMetadata(offsets=chunk.offsets, sizes=chunk.sizes)  # (one per item)
    return WriteItem(
        index=MetadataIndex(fqn, chunk.offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=mine, properties=properties, size=size),
    )
