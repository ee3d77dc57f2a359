"""Staging for objects that implement torch's checkpointable protocol.

DCP asks three things of an object in a state dict that is not a plain tensor, ``DTensor`` or
``ShardedTensor``: ``__create_write_items__(fqn, obj)`` (what it writes), ``__create_chunk_list__()``
(the chunks it holds, for a load plan) and ``__get_tensor_shard__(index)`` (the local tensor behind
one write item). torch's planner tests for them with ``hasattr`` (``planner_helpers.
_create_write_items``/``_create_chunk_list``, ``utils.find_tensor_shard``); torch describes them as
``torch.distributed._checkpointable._Checkpointable``. Such an object may hold no storage of its
own: Megatron-Core's ``CheckpointableShardedTensor`` is a wrapper subclass over a shard of a larger
tensor, and any tensor operation on it (``detach``, ``numel``) raises.

Staging asks the object once for its write items and, for each, its local tensor; the bytes staged
(and counted by ``staging_size``) are those tensors', never the global shape's. The staged state
dict holds a :class:`StagedCheckpointable` in its place: a storage-less tensor wrapper of the same
global shape that answers the same three calls from what was recorded, with the staged tensors. The
write items are recorded with the key they are called with at plan time (DCP flattens nested keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from tierckpt_core.errors import CheckpointFormatError

_PROTOCOL = ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__")


def is_checkpointable(obj: Any) -> bool:
    """True for an object that implements torch's checkpointable protocol (DCP's own test)."""
    return all(hasattr(obj, name) for name in _PROTOCOL)


def local_tensors(obj: Any) -> list[tuple[WriteItem, torch.Tensor]]:
    """The object's write items, each with the local tensor DCP would write for it."""
    try:
        items = obj.__create_write_items__("", obj)
        pairs = [(item, obj.__get_tensor_shard__(item.index)) for item in items]
    except NotImplementedError as e:
        raise CheckpointFormatError(
            f"cannot stage a {type(obj).__name__}: it does not implement torch's checkpointable "
            f"protocol fully ({e})"
        ) from e
    for item, t in pairs:
        if not isinstance(t, torch.Tensor) or item.tensor_data is None:
            raise CheckpointFormatError(
                f"cannot stage a {type(obj).__name__}: its write item {item.index} is not a "
                "tensor shard"
            )
    return pairs


def stage_checkpointable(
    obj: Any, on_tensor: Callable[[torch.Tensor], torch.Tensor]
) -> StagedCheckpointable:
    """``obj``'s stand-in in a staged state dict, its local tensors passed through ``on_tensor``."""
    pairs = local_tensors(obj)
    items = [item for item, _ in pairs]
    tensors = [on_tensor(t.detach()) for _, t in pairs]
    shape, dtype = (obj.shape, obj.dtype) if isinstance(obj, torch.Tensor) else _global(items)
    return StagedCheckpointable.build(
        shape, dtype, items, list(obj.__create_chunk_list__()), tensors
    )


def _global(items: list[WriteItem]) -> tuple[torch.Size, torch.dtype]:
    if not items or items[0].tensor_data is None:
        return torch.Size([0]), torch.float32
    return items[0].tensor_data.size, items[0].tensor_data.properties.dtype


class StagedCheckpointable(torch.Tensor):
    """A staged checkpointable object: the write items and chunks recorded when it was staged,
    with the staged local tensors. Like the object it stands for, it supports no tensor
    operation; DCP only plans with it and reads its shards. Pickled as its parts (PROCESS mode)."""

    _items: list[WriteItem]
    _chunks: list[ChunkStorageMetadata]
    _tensors: list[torch.Tensor]

    @staticmethod
    def build(
        shape: torch.Size,
        dtype: torch.dtype,
        items: list[WriteItem],
        chunks: list[ChunkStorageMetadata],
        tensors: list[torch.Tensor],
    ) -> StagedCheckpointable:
        r = torch.Tensor._make_wrapper_subclass(StagedCheckpointable, shape, dtype=dtype)
        r._items, r._chunks, r._tensors = items, chunks, tensors
        return r

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (
            StagedCheckpointable.build,
            (self.shape, self.dtype, self._items, self._chunks, self._tensors),
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise NotImplementedError(
            f"{func} on a staged checkpointable object: it only stands in for a save"
        )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [replace(i, index=replace(i.index, fqn=fqn)) for i in self._items]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return list(self._chunks)

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        at = index.index
        if (
            at is not None
            and at < len(self._items)
            and self._items[at].index.offset == index.offset
        ):
            return self._tensors[at]
        for item, t in zip(self._items, self._tensors, strict=True):
            if item.index.offset == index.offset:
                return t
        raise ValueError(f"no staged shard at offset {index.offset} for '{index.fqn}'")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"StagedCheckpointable(shape={tuple(self.shape)}, shards={len(self._tensors)})"
