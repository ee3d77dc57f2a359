"""Staging: copy a state dict's tensors straight into one leased tier file (one copy, no second one).

:func:`stage_into` walks the state dict like DCP does (mappings and lists; other values are leaves),
lays every tensor's bytes out back to back (64-byte aligned) and copies each one into its place. It
returns a state dict of the same shape whose tensors alias the file; DTensors keep their spec with the
local tensor replaced, and ShardedTensors are rebuilt around their staged local shards with the same
global metadata. Objects that implement torch's checkpointable protocol (Megatron-Core's sharded
tensors) are staged by their local tensors (:mod:`_checkpointable`). Non-tensor leaves are
deep-copied so that training may change the originals.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.tensor import DTensor

from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._arena import FileMapping
from tierckpt_client.dcp._byte_copy import ByteCopies, plain
from tierckpt_client.dcp._checkpointable import (
    is_checkpointable,
    local_tensors,
    stage_checkpointable,
)
from tierckpt_client.dcp._metadata_codec import copy_tensor, dtype_name
from tierckpt_core.errors import CheckpointFormatError

ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


Skip = Callable[[torch.Tensor], bool] | None  # a leaf this rank will not write (see _assign)


def placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape and dtype without bytes: the planner builds the same plan from
    it, and a save that had to write it fails loudly (``meta``) instead of writing garbage."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _walk(obj: Any, on_tensor: Callable[[torch.Tensor], torch.Tensor], skip: Skip = None) -> Any:
    # The common leaves first, by exact type (a plain tensor is none of the kinds below):
    # with thousands of tensors, each test of the chain cost the stall microseconds apiece.
    kind = type(obj)
    if kind is torch.Tensor:
        return placeholder(obj) if skip is not None and skip(obj) else on_tensor(obj.detach())
    if kind is dict:
        return {k: _walk(v, on_tensor, skip) for k, v in obj.items()}
    if isinstance(obj, ShardedTensor):
        # Before Tensor: a ShardedTensor is a tensor subclass with no storage of its own.
        shards = [Shard(on_tensor(s.tensor.detach()), s.metadata) for s in obj.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, obj.metadata(), process_group=obj._process_group
        )
    if isinstance(obj, DTensor):
        if skip is not None and skip(obj):
            local = placeholder(obj._local_tensor)
        else:
            local = on_tensor(obj._local_tensor.detach())
        return DTensor(local, obj._spec, requires_grad=False)
    if is_checkpointable(obj):  # before Tensor: it may have no storage (detach() raises)
        return stage_checkpointable(obj, on_tensor)
    if isinstance(obj, torch.Tensor):
        if skip is not None and skip(obj):
            return placeholder(obj)
        return on_tensor(obj.detach())
    if isinstance(obj, dict):
        return {k: _walk(v, on_tensor, skip) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, on_tensor, skip) for v in obj]
    return copy.deepcopy(obj)


_STORABLE: set[torch.dtype] = set()  # dtypes dtype_name() accepted


def _check(t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise CheckpointFormatError(f"cannot stage a tensor with layout {t.layout}; only strided")
    if t.dtype not in _STORABLE:
        dtype_name(t.dtype)  # a dtype tierckpt cannot store fails here, before anything is copied
        _STORABLE.add(t.dtype)


def staging_size(state_dict: dict[str, Any], skip: Skip = None) -> int:
    """Bytes of the file that :func:`stage_into` needs for ``state_dict`` (without ``skip``)."""
    total = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        _check(t)
        total += align(_nbytes(t))
        return t

    _walk_tensors_only(state_dict, count, skip)
    return total


def _walk_tensors_only(
    obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], skip: Skip = None
) -> None:
    kind = type(obj)  # the common leaves first, as in _walk
    if kind is torch.Tensor:
        if skip is None or not skip(obj):
            fn(obj)
    elif kind is dict:
        for v in obj.values():
            _walk_tensors_only(v, fn, skip)
    elif isinstance(obj, ShardedTensor):
        for shard in obj.local_shards():
            fn(shard.tensor)
    elif isinstance(obj, DTensor):  # before the protocol: a DTensor implements it too
        if skip is None or not skip(obj):
            fn(obj._local_tensor)
    elif is_checkpointable(obj):  # before Tensor: it may have no storage of its own
        for _, t in local_tensors(obj):
            fn(t)
    elif isinstance(obj, torch.Tensor):
        if skip is None or not skip(obj):
            fn(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk_tensors_only(v, fn, skip)
    elif isinstance(obj, list):
        for v in obj:
            _walk_tensors_only(v, fn, skip)


@dataclass
class StageResult:
    state_dict: dict[str, Any]
    used_bytes: int
    device_copies: int


def stage_into(
    state_dict: dict[str, Any],
    mapping: FileMapping | None,
    *,
    pin_memory: bool = True,
    skip: Skip = None,
) -> StageResult:
    """Copy every tensor of ``state_dict`` into ``mapping``; return the aliasing state dict.
    A tensor or DTensor for which ``skip`` says so is not copied: a :func:`placeholder` stands in
    for it (a tensor this rank does not write, see ``_assign``).
    With CUDA tensors among them and ``pin_memory``, the mapping is registered as page-locked
    memory (:func:`_arena.pin`) before the first device copy, so each is an asynchronous DMA on
    the current stream of its device; at the end one synchronize of each such stream waits for
    them all (of those streams only: an asynchronous stage runs on a side stream of its own, and
    must not wait for the training's kernels on the others, :mod:`_async_staging`). Host tensors are copied as bytes, all together
    once they are laid out, shared over up to torch's number of threads (:mod:`_byte_copy`)."""
    offset = 0
    device_copies = 0
    devices: set[torch.device] = set()
    base = mapping.base if mapping is not None else 0
    host = ByteCopies(torch.get_num_threads())

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset, device_copies
        n = _nbytes(t)
        if n == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        assert mapping is not None
        at, offset = offset, offset + align(n)
        dst = mapping.placed(at, t.dtype, t.shape)
        if t.device.type == "cpu":
            if plain(t):
                host.add(base + at, t, n, dst)
            else:
                copy_tensor(dst, t)
        else:
            if not device_copies and pin_memory and t.device.type == "cuda":
                _arena.pin(mapping)
            copy_tensor(dst, t, non_blocking=True)
            device_copies += 1
            devices.add(t.device)
        return dst

    try:
        staged = _walk(state_dict, place, skip)
    except BaseException:
        host.cancel()  # no helper writes into the file once this returns
        raise
    host.run()
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        else:  # another accelerator: its own device-wide wait
            torch.accelerator.synchronize(device)
    return StageResult(staged, offset, device_copies)
