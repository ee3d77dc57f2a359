"""A load plan for the common resume, made without DCP's general planning.

DCP's default load planner matches each tensor of the state dict against the chunks the step
stored (a sweep over the chunks' bounds, for any resharding): ~20-25 us a tensor on the 2-core
box, ~50 ms of a 2048-tensor restore of 64 MiB. When a :class:`~tierckpt_client.Checkpointer`
resumes the job that saved, every tensor is read whole from one stored chunk of its own shape:
the plan is one read item per tensor, which :class:`LoadPlanner` writes out directly (the same
items, equal field by field, as DCP's planner makes: tested). Anything else (a key the step
lacks, a tensor stored in several chunks or of another shape, a ``DTensor``, a
``ShardedTensor``, an object DCP asks for its own chunks) leaves the whole plan to DCP.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with :func:`whole_plan` tried first. The destination of one
    of its items is the state dict's tensor itself (DCP finds it by key and narrows it to the
    whole of itself: ~6 us a tensor); any other item is resolved by DCP."""

    _targets: dict[int, tuple[ReadItem, torch.Tensor]] = {}

    def create_local_plan(self) -> LoadPlan:
        self._targets = {}
        if self.metadata is not None and not self.allow_partial_load:
            plan = whole_plan(self.state_dict, self.metadata.state_dict_metadata)
            if plan is not None:
                self._targets = {
                    id(item): (item, self.state_dict[item.dest_index.fqn])
                    for item in plan.items
                    if item.type == LoadItemType.TENSOR
                }
                return plan
        return super().create_local_plan()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        mine = self._targets.get(id(read_item))
        if mine is not None and mine[0] is read_item:
            return mine[1]
        return super().resolve_tensor(read_item)


def whole_plan(state_dict: Mapping[str, object], stored: Mapping[str, object]) -> LoadPlan | None:
    """The load plan of a flattened ``state_dict`` whose every key ``stored`` has and whose
    every tensor is a plain one, stored whole in one chunk of its shape; else None. Keys stored
    that ``state_dict`` lacks are not read, as DCP does (a rank of a pipeline stage loads its
    own layers out of a step that holds every stage's)."""
    items: list[ReadItem] = []
    origins: dict[int, torch.Size] = {}  # the zero offsets of each number of dimensions
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
        if type(md) is not TensorStorageMetadata or type(obj) not in _PLAIN:
            return None
        assert isinstance(md, TensorStorageMetadata) and isinstance(obj, torch.Tensor)
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
        index = MetadataIndex(fqn, zeros, 0)  # the chunk's offsets are zeros too
        items.append(ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, size))
    return LoadPlan(items)
