"""How a rank lays out its save items in files: where a staged tensor already lives, and one more
file for bytes items and tensors that were not staged.

Kept apart from ``writer`` so that the writer reads as the DCP call order and this module as the
byte layout (64-byte aligned, raw tensor bytes with dtype and shape in the ``ShardRef``).
"""

from __future__ import annotations

import ctypes
import io
import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._metadata_codec import ShardRef, copy_tensor, dtype_name
from tierckpt_client.dcp._staging import align
from tierckpt_client.dcp.targets.base import OutFile, SaveTarget
from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.integrity import block_digest


@dataclass(frozen=True)
class SaveStats:
    """What one rank's ``write_data`` did, for metrics and tests.

    ``copied_bytes`` counts tensor bytes that had to be copied in ``write_data`` because they were not
    staged into the tier (plain ``dcp.save``, or a planner that replaced tensors); with
    ``async_save`` it is 0.
    """

    staged_bytes: int
    copied_bytes: int
    bytes_items: int

    @classmethod
    def of(
        cls, results: list[WriteResult], pending: list[tuple[Any, Any]], staged: str, copied: int
    ) -> SaveStats:
        """From the items ``place`` found in the ``staged`` file and the ``pending`` others."""
        return cls(
            staged_bytes=sum(r.size_in_bytes for r in results if r.storage_data.file == staged),
            copied_bytes=copied,
            bytes_items=sum(1 for _, v in pending if not isinstance(v, torch.Tensor)),
        )


SEGMENT_MAX = 64 << 10  # items up to this size get a checksum of their own (see segments)


def segments(
    results: list[WriteResult], mapping: _arena.FileMapping, name: str
) -> list[tuple[int, int, str]]:
    """Checksums of the small items of the staged file (a save across nodes): a rank on another
    node that needs one of them (a replicated value DCP had this rank write) then fetches it
    alone, verified, instead of the whole file."""
    out = []
    for r in results:
        ref = r.storage_data
        if ref.file == name and 0 < ref.length <= SEGMENT_MAX:
            data = mapping.view(ref.offset, ref.length).numpy().tobytes()
            out.append((ref.offset, ref.length, block_digest(data)))
    return out


def resolve(item: Any, planner: SavePlanner) -> torch.Tensor | bytes:
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise CheckpointFormatError(
                f"{item.index.fqn}: the planner resolved a bytes item to "
                f"{type(data).__name__}, not io.BytesIO"
            )
        return data.getvalue()
    if not isinstance(data, torch.Tensor):
        raise CheckpointFormatError(
            f"{item.index.fqn}: the planner resolved a tensor item to {type(data).__name__}"
        )
    return data.detach()


def staged_ref(t: torch.Tensor, mapping: _arena.FileMapping, name: str) -> ShardRef | None:
    """Where ``t`` lives in the staged file, if stage() put it there (no copy needed)."""
    nbytes = t.numel() * t.element_size()
    if not nbytes or t.device.type != "cpu" or not t.is_contiguous():
        return None
    offset = t.data_ptr() - mapping.base
    if not 0 <= offset <= mapping.size - nbytes:
        return None
    return ShardRef(name, offset, nbytes, dtype_name(t.dtype), tuple(t.shape))


def place(
    plan: SavePlan, planner: SavePlanner, mapping: _arena.FileMapping | None, name: str
) -> tuple[list[WriteResult], list[tuple[MetadataIndex, Any]]]:
    """The write results of the items that ``stage()`` put in the staged file ``mapping`` (to be
    sealed as ``name``), and the items still to copy (:func:`pack_extra`)."""
    results: list[WriteResult] = []
    pending: list[tuple[MetadataIndex, Any]] = []
    for item in plan.items:
        value = resolve(item, planner)
        ref = None
        if isinstance(value, torch.Tensor) and mapping is not None:
            ref = staged_ref(value, mapping, name)
        if ref is None:
            pending.append((item.index, value))
        else:
            results.append(
                WriteResult(index=item.index, size_in_bytes=ref.length, storage_data=ref)
            )
    return results, pending


def compact(results: list[WriteResult], mapping: _arena.FileMapping, name: str) -> int:
    """Move the items of the staged file ``name`` that the save references to its front, back to
    back (64-byte aligned, in file order), update their ``ShardRef`` offsets, and return the bytes
    used: the length to seal. Whatever else ``stage()`` copied (an item DCP gave another rank to
    write) is left behind the length, and the daemon cuts it off when the file is sealed (see
    docs/design.md, "Replicated state is stored once"). Call it after every item that reads
    from the staged file (``pack_extra``) has been copied: moved bytes overwrite others.

    Items whose bytes overlap (two items over one staged tensor) are not moved: the length is
    then the end of the last referenced byte."""
    mine = sorted(
        (i for i, r in enumerate(results) if r.storage_data.file == name),
        key=lambda i: results[i].storage_data.offset,
    )
    refs = [results[i].storage_data for i in mine]
    if any(a.offset + a.length > b.offset for a, b in itertools.pairwise(refs)):
        return max(r.offset + r.length for r in refs)
    at = 0
    for i, ref in zip(mine, refs, strict=True):
        if ref.offset != at:
            ctypes.memmove(mapping.base + at, mapping.base + ref.offset, ref.length)
            results[i] = replace(results[i], storage_data=replace(ref, offset=at))
        at += align(ref.length)
    return at


BYTES_ITEM_ROOM = 4096  # what planned_size allows for each bytes item (its size is not known yet)


def planned_size(plan: SavePlan) -> int:
    """Bytes :func:`pack_extra` will most likely need for ``plan``'s items: the tensors' bytes
    exactly, and some room for each bytes item (pickled only in write_data)."""
    size = 0
    tensors = False
    for item in plan.items:
        data = item.tensor_data
        if data is None:
            size += BYTES_ITEM_ROOM
            continue
        tensors = True
        size += align(math.prod(data.chunk.sizes) * data.properties.dtype.itemsize)
    return size if tensors else 0


def pack_extra(
    target: SaveTarget,
    namespace: str,
    rank: int,
    pending: list[tuple[MetadataIndex, Any]],
    discard: Any,
    reserved: OutFile | None = None,
    pin_memory: bool = False,
) -> tuple[OutFile | None, list[WriteResult], int]:
    """Copy bytes items and unstaged tensors into one more file of the target: ``reserved``
    (leased when the save was planned) if it is large enough, else a new one. Returns the file
    (its length the bytes used), the write results and the tensor bytes copied. With
    ``pin_memory``, a file that takes a CUDA tensor is registered as page-locked first (a plain
    ``dcp.save`` of GPU state: DMA into the tier instead of a copy through pageable memory)."""
    name = f"r{rank:05d}.extra"
    sizes = [
        v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v) for _, v in pending
    ]
    need = sum(align(n) for n in sizes)
    if reserved is not None and (not pending or reserved.length < need):
        discard(namespace, reserved)
        reserved = None
    if not pending:
        return None, [], 0
    if reserved is not None:
        out = replace(reserved, name=name)
    else:
        out = target.new_file(namespace, rank, name, max(need, 1))
    try:
        mapping = out.mapping()
        results = []
        offset = 0
        copied = 0
        for (index, value), n in zip(pending, sizes, strict=True):
            dst = mapping.view(offset, n)
            if isinstance(value, torch.Tensor):
                ref = ShardRef(name, offset, n, dtype_name(value.dtype), tuple(value.shape))
                if n and pin_memory and value.device.type == "cuda":
                    _arena.pin(mapping)  # registers the file once; a no-op after
                if n:
                    copy_tensor(dst.view(value.dtype).view(value.shape), value)
                copied += n
            else:
                if n:
                    dst.copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))
                ref = ShardRef(name, offset, n)
            results.append(WriteResult(index=index, size_in_bytes=n, storage_data=ref))
            offset += align(n)
    except BaseException:
        discard(namespace, out)
        raise
    out.length = offset
    return out, results, copied
