"""A load plan for the common resume, made without DCP's general planning.

DCP's default load planner matches each tensor of the state dict against the chunks the step
stored (a sweep over the chunks' bounds, for any resharding): ~20-25 us a tensor on the 2-core
box, ~50 ms of a 2048-tensor restore of 64 MiB. When a :class:`~tierckpt_client.Checkpointer`
resumes the job that saved, every tensor is read whole from one stored chunk of its own shape:
the plan is one read item per tensor, which :class:`LoadPlanner` writes out directly (the same
items, equal field by field, as DCP's planner makes: tested).

A ``DTensor`` (FSDP2, HSDP, tensor parallel) resumed on the mesh and placements it was saved
with is read the same way: its local shard whole from the one stored chunk at its offsets.
DCP works its local chunk out for every tensor (~50-130 us each on the 2-core box, with a sweep
over the stored chunks after it); the tensors of a model share a few shapes, so the chunk is
worked out once per shape, mesh and placements (by the ``DTensor`` itself, as DCP asks it).

DCP's ``set_up_planner`` walks the state dict three times (meta tensors made real, nested
``ShardedTensor``s flattened, then the keys flattened to dotted names: ~6 us a tensor on the
2-core box, ~13 ms of a 2048-tensor restore). For a state of dicts whose values are plain tensors,
``DTensor``s and scalars, none on the meta device, the first two change nothing, and
:func:`flat_state` makes the third's result in one walk (equal to DCP's: tested); anything else is
DCP's walk.

Anything else (a key the step lacks, a tensor stored in several chunks or of another shape, a
``DTensor`` whose shard is not one stored chunk (another mesh: resharding), a
``ShardedTensor``, a subclass, an object DCP asks for its own chunks) leaves the whole plan to
DCP.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from tierckpt_client._shards import PLAIN, plain_shard

# A local plan made here, shipped through DCP's coordinator without its items.
_KEPT = "tierckpt: items kept on the rank"


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with :func:`whole_plan` tried first. The destination of one
    of its items is the state dict's tensor itself, or a ``DTensor``'s shard (DCP finds it by
    key and narrows it to the whole of itself: ~6 us a tensor, ~60 us a ``DTensor``, whose
    ``to_local`` goes through autograd); any other item is resolved by DCP.

    DCP ships every rank's plan to its coordinator and back (pickled both ways, ~25 us an item
    on the 2-core box, whenever a process group is set up, one rank included), although the
    load's global plan is each rank's own. A plan made here travels without its items and
    :meth:`finish_plan` puts them back; an item that still comes back as a copy (a planner
    around this one that ships them) is known by its key, and is the one planned here if it is
    equal to it."""

    _targets: dict[str, tuple[ReadItem, torch.Tensor]] = {}
    _kept: LoadPlan | None = None

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        flat = (
            flat_state(state_dict)
            if self.flatten_state_dict and self.flatten_sharded_tensors
            else None
        )
        if flat is None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            return
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flat  # (DCP's mappings hold paths of str and int)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        self._targets, self._kept = {}, None
        if self.metadata is not None and not self.allow_partial_load:
            targets: dict[str, tuple[ReadItem, torch.Tensor]] = {}
            plan = whole_plan(
                self.state_dict,
                self.metadata.state_dict_metadata,
                targets=targets,
                keys=_first_chunks(self.metadata.storage_data),
            )
            if plan is not None:
                self._targets = targets
                self._kept = plan
                return LoadPlan([], planner_data=_KEPT)
        return super().create_local_plan()

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        if self._kept is not None and new_plan.planner_data == _KEPT and not new_plan.items:
            return replace(new_plan, items=self._kept.items, planner_data=None)
        return super().finish_plan(new_plan)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        mine = self._targets.get(read_item.dest_index.fqn)
        if mine is not None and (mine[0] is read_item or mine[0] == read_item):
            return mine[1]
        return super().resolve_tensor(read_item)


_SCALARS = (int, float, str, bytes, io.BytesIO, type(None))
"""Values DCP's ``set_up_planner`` leaves as they are, besides tensors and dicts."""


Path = tuple[str | int, ...]


def flat_state(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Path]] | None:
    """What DCP's ``set_up_planner`` makes of ``state_dict`` (the flattened state dict and its
    mappings, dotted name -> path), for a state of dicts and lists (any depth) whose values are
    plain tensors or ``DTensor``s (none on the meta device) or scalars (and tuples of scalars);
    else None (a ``ShardedTensor``, a meta tensor, a tuple holding a tensor, any other object: DCP's own walk). A list is walked as DCP
    walks it: into it (by index) where it holds a tensor or a dict at any depth, else as one
    value. Raises DCP's error for two paths with one dotted name."""
    if _version._derived_version == "2_3":
        return None  # (DCP walks an old checkpoint's state otherwise)
    flat: dict[str, Any] = {}
    mappings: dict[str, Path] = {}

    def walk(items: Iterable[tuple[Any, Any]], path: Path, prefix: str, listed: bool) -> bool:
        for k, v in items:
            name = str(k)
            at = (*path, k if listed else name)  # (a list's index stays an int in the path)
            fqn = prefix + name
            kind = type(v)
            if kind in PLAIN or kind is DTensor:
                if v.device.type == "meta":
                    return False
            elif isinstance(v, dict):  # (an OrderedDict too: a module's state_dict())
                if not walk(v.items(), at, fqn + ".", False):
                    return False
                continue
            elif kind is list:
                inside = _holds_tensors(v)
                if inside is None:
                    return False
                if inside:
                    if not walk(enumerate(v), at, fqn + ".", True):
                        return False
                    continue
            elif not _scalar(v):
                return False
            if fqn in flat:
                raise ValueError(f"duplicated flatten key {fqn}")
            flat[fqn] = v
            mappings[fqn] = at
        return True

    if not walk(state_dict.items(), (), "", False):
        return None
    return flat, mappings


def _holds_tensors(values: list[Any]) -> bool | None:
    """Whether DCP walks into list ``values`` (it holds a tensor or a dict, at any depth in
    lists); None if it holds anything but those, lists and scalars."""
    for v in values:
        kind = type(v)
        if kind in PLAIN or kind is DTensor or isinstance(v, dict):
            return True
        if kind is list:
            inside = _holds_tensors(v)
            if inside is None or inside:
                return inside
        elif not _scalar(v):
            return None
    return False


def _scalar(v: Any) -> bool:
    """A value DCP stores as one object: a scalar, or a tuple of them (Adam's ``betas``)."""
    return isinstance(v, _SCALARS) or (type(v) is tuple and all(_scalar(e) for e in v))


def _local(obj: Any) -> torch.Tensor:
    """What an item of :func:`whole_plan` lands in: the tensor, or a ``DTensor``'s shard."""
    shard = plain_shard(obj)
    return obj if shard is None else shard


def _first_chunks(storage: Any) -> dict[str, MetadataIndex]:
    """The storage keys of the steps' first chunks by name (``storage``: a step metadata's
    ``storage_data``), for :func:`whole_plan`'s items to hold: the reader's lookup of each
    item's bytes then finds its own key (the same object: no comparison of fields)."""
    if not isinstance(storage, dict):
        return {}
    return {k.fqn: k for k in storage if type(k) is MetadataIndex and k.index == 0}


def whole_plan(
    state_dict: Mapping[str, object],
    stored: Mapping[str, object],
    *,
    targets: dict[str, tuple[ReadItem, torch.Tensor]] | None = None,
    keys: Mapping[str, MetadataIndex] | None = None,
) -> LoadPlan | None:
    """The load plan of a flattened ``state_dict`` whose every key ``stored`` has and whose
    every tensor is a plain one stored whole in one chunk of its shape, or a ``DTensor`` whose
    local shard is one stored chunk; else None. Keys stored that ``state_dict`` lacks are not
    read, as DCP does (a rank of a pipeline stage loads its own layers out of a step that holds
    every stage's). ``targets``: filled with each tensor item and what it lands in (the tensor,
    or a ``DTensor``'s shard); ``keys``: the stored chunks' keys by name, which the items take
    where equal (:func:`_first_chunks`)."""
    keys = keys or {}
    items: list[ReadItem] = []
    origins: dict[int, torch.Size] = {}  # the zero offsets of each number of dimensions
    # Each shape, mesh and placements' local chunk, and where the last tensor found it stored.
    shards: dict[tuple[Any, ...], tuple[ChunkStorageMetadata, int] | None] = {}
    for fqn, obj in state_dict.items():
        md = stored.get(fqn)
        if md is None:
            return None
        if type(md) is BytesStorageMetadata:
            if isinstance(obj, torch.Tensor):
                return None  # (DCP says what is wrong)
            index = MetadataIndex(fqn)
            at = torch.Size((0,))
            items.append(ReadItem(LoadItemType.BYTE_IO, index, at, index, at, at))
            continue
        if type(md) is not TensorStorageMetadata:
            return None
        assert isinstance(md, TensorStorageMetadata)
        if type(obj) is DTensor:
            shard = _shard_items(fqn, obj, md, shards)
            if shard is None:
                return None
            items += shard
            if targets is not None and shard:
                targets[fqn] = (shard[0], _local(obj))
            continue
        if type(obj) not in PLAIN:
            return None
        assert isinstance(obj, torch.Tensor)
        size = obj.size()
        if len(md.chunks) != 1 or md.size != size:
            return None
        chunk = md.chunks[0]
        if chunk.sizes != size or any(chunk.offsets):
            return None
        if not obj.numel():
            continue  # nothing to read (DCP plans no item for it either)
        zeros = origins.get(len(size))
        if zeros is None:
            zeros = origins[len(size)] = torch.Size([0] * len(size))
        key = keys.get(fqn)  # (the chunk's offsets are zeros too)
        index = key if key is not None and key.offset == zeros else MetadataIndex(fqn, zeros, 0)
        item = ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, size)
        items.append(item)
        if targets is not None:
            targets[fqn] = (item, obj)
    return LoadPlan(items)


def _shard_items(
    fqn: str,
    obj: DTensor,
    md: TensorStorageMetadata,
    shards: dict[tuple[Any, ...], tuple[ChunkStorageMetadata, int] | None],
) -> list[ReadItem] | None:
    """The read item of a ``DTensor`` whose local shard is a stored chunk (none for an empty
    shard: nothing to read); None if it is not one (DCP plans the state)."""
    size = obj.size()
    if md.size != size or plain_shard(obj) is None:
        return None
    if obj.device_mesh.get_coordinate() is None:
        return []  # a DTensor of a mesh this rank is not part of: DCP reads nothing for it
    key = (size, obj.device_mesh, obj.placements)
    if key in shards:
        known = shards[key]
    else:
        chunks = obj.__create_chunk_list__()  # (raises for a Partial placement, as DCP does)
        known = shards[key] = (chunks[0], 0) if len(chunks) == 1 else None
    if known is None:
        return None
    local, hint = known
    if not local.sizes.numel():
        return []  # (DCP may plan reads of no bytes for it)
    chunks = md.chunks
    if hint < len(chunks) and _same(chunks[hint], local):
        index = hint  # where the previous tensor of this shape found its chunk: the usual place
    else:
        index = next((i for i, c in enumerate(chunks) if _same(c, local)), -1)
        if index < 0:
            return None
        shards[key] = (local, index)
    zeros = torch.Size([0] * len(local.sizes))
    dest = MetadataIndex(fqn, local.offsets, 0)
    stored = dest if index == 0 else MetadataIndex(fqn, local.offsets, index)
    return [ReadItem(LoadItemType.TENSOR, dest, zeros, stored, zeros, local.sizes)]


def _same(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return a.offsets == b.offsets and a.sizes == b.sizes
