"""DCP ``Metadata`` <-> JSON, so that no checkpoint ever needs unpickling to be understood.

The JSON form is documented in docs/format.md. Decoding treats its input as untrusted: every field is
type-checked and dtypes come from a fixed table, and any problem raises
:class:`~tierckpt_core.errors.CheckpointFormatError` naming the field.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tierckpt_client import _gc_pause
from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.metadata_blob import pack_metadata, unpack_metadata

FORMAT = "tierckpt-dcp-metadata/1"

# Quantized dtypes carry a scale and zero point besides their bytes: raw bytes cannot hold them.
_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
# Every other dtype torch has is stored as raw bytes plus its name (complex32, the float8 and
# float4 formats, the sub-byte ints, the bits types), as torch's own writer stores them.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and str(d).removeprefix("torch.") not in _QUANTIZED
}
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve_format": torch.preserve_format,
}


@dataclass(frozen=True)
class ShardRef:
    """Where one write item lives: a byte range of a tier file, raw (tensor bytes or a bytes item).

    ``dtype``/``shape`` are set for tensors: the bytes are the chunk, C-contiguous.
    """

    file: str
    offset: int
    length: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


def metadata_text(md: Metadata) -> str:
    """``md`` as the daemons keep it (tierckpt_core.metadata_blob): encoded and packed, with the
    garbage collector paused: that builds several objects per chunk of every tensor (N·M·T
    chunks for the job), none of them garbage, and the collector's passes over them were more
    than half the time (bench/decode_metadata.py)."""
    with _gc_pause.paused():
        return pack_metadata(encode_metadata(md))


def metadata_from_text(text: str, *, where: str) -> Metadata:
    """The metadata kept as ``text`` (untrusted: see :func:`decode_metadata`), inflated, parsed
    and decoded with the garbage collector paused (as :func:`metadata_text`)."""
    with _gc_pause.paused():
        return decode_metadata(unpack_metadata(text, where=where))


# The metadata of the steps this process loaded, decoded, by the document the source answered
# with: decoding it costs ~10 us per tensor, on every load, where the document is the same. By its
# text, not the object: the steps of one layout share it (the same files, offsets and tensors),
# so a load of a new step of the layout last loaded decodes nothing.
_DECODED: OrderedDict[str, Metadata] = OrderedDict()
_DECODED_MAX = 8
_DECODED_LOCK = threading.Lock()


def decoded(doc: str, *, where: str) -> Metadata:
    """The metadata kept as ``doc`` (tierckpt_core.metadata_blob: inflated, parsed, decoded),
    decoded once per document; each load gets its own copy of the tables (DCP and a user's
    planner may keep or change what they are given)."""
    with _DECODED_LOCK:
        metadata = _DECODED.get(doc)
        if metadata is not None:
            _DECODED.move_to_end(doc)
    if metadata is None:
        metadata = metadata_from_text(doc, where=where)
        with _DECODED_LOCK:
            _DECODED[doc] = metadata
            while len(_DECODED) > _DECODED_MAX:
                _DECODED.popitem(last=False)
    return replace(
        metadata,
        state_dict_metadata=dict(metadata.state_dict_metadata),
        planner_data=dict(metadata.planner_data) if metadata.planner_data is not None else None,
        storage_data=dict(metadata.storage_data or {}),
    )


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name in _QUANTIZED:
        raise CheckpointFormatError(
            f"dtype {dtype} cannot be stored by tierckpt: a quantized tensor's scale and zero point "
            "are not in its bytes; save its int_repr() and quantization parameters instead"
        )
    if name not in DTYPES:
        raise CheckpointFormatError(f"dtype {dtype} is not supported by tierckpt")
    return name


def copy_tensor(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for every storable dtype: one-byte dtypes (the sub-byte ints have no
    copy kernel) are copied as their bytes, which is the same copy."""
    if dst.dtype == src.dtype and dst.dtype.itemsize == 1 and dst.dtype != torch.uint8:
        dst = dst.view(torch.uint8)
        src = src.view(torch.uint8)
    dst.copy_(src, non_blocking=non_blocking)


NUMPY_DTYPES = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
"""The dtypes numpy has: ``tensor.numpy()`` takes a contiguous CPU tensor of these as it is."""


def takes_whole(item: Any, ref: ShardRef, target: torch.Tensor) -> bool:
    """Whether read item ``item`` reads all of stored tensor ``ref`` into a ``target`` of its
    dtype and shape (a copy of bytes, no narrowing nor conversion)."""
    shape = ref.shape  # (a tuple: torch.Size compares equal to it; thousands of items a load)
    return (
        ref.dtype is not None
        and shape is not None
        and tuple(item.lengths) == shape
        and not any(item.storage_offsets)
        and target.dtype == DTYPES[ref.dtype]
        and target.size() == shape
    )


def dtype_from_name(name: object, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise CheckpointFormatError(f"{where}: unknown dtype {name!r}")
    return DTYPES[name]


def encode_metadata(md: Metadata) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            p = item.properties
            mf = next((k for k, v in _MEMORY_FORMATS.items() if v == p.memory_format), None)
            sd[fqn] = {
                "kind": "tensor",
                "dtype": dtype_name(p.dtype),
                "requires_grad": bool(p.requires_grad),
                "memory_format": mf or "contiguous_format",
                "size": list(item.size),
                "chunks": [
                    {"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks
                ],
            }
        elif isinstance(item, BytesStorageMetadata):
            sd[fqn] = {"kind": "bytes"}
        else:
            raise CheckpointFormatError(
                f"{fqn}: cannot store metadata of type {type(item).__name__}"
            )
    storage: list[dict[str, Any]] = []
    for index, ref in (md.storage_data or {}).items():
        if not isinstance(ref, ShardRef):
            raise CheckpointFormatError(f"{index.fqn}: storage data is not a tierckpt ShardRef")
        storage.append(
            {
                "fqn": index.fqn,
                "offset": list(index.offset) if index.offset is not None else None,
                "index": index.index,
                "file": ref.file,
                "file_offset": ref.offset,
                "length": ref.length,
                "dtype": ref.dtype,
                "shape": list(ref.shape) if ref.shape is not None else None,
            }
        )
    sm = md.storage_meta
    return {
        "format": FORMAT,
        "version": md.version,
        "state_dict_metadata": sd,
        "storage_data": storage,
        "planner_data": _encode_planner_data(md.planner_data),
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        },
    }


def _encode_planner_data(pd: Any) -> Any:
    # DefaultSavePlanner stores {flattened fqn: path tuple of str/int keys}; keep what is JSON-safe.
    if not isinstance(pd, dict):
        return None
    out = {}
    for k, v in pd.items():
        if (
            isinstance(k, str)
            and isinstance(v, tuple | list)
            and all(isinstance(x, str | int) for x in v)
        ):
            out[k] = list(v)
    return out


def _ints(value: object, where: str) -> list[int]:
    # A plain loop on exact types (bool is not int here): called for every chunk's offsets and
    # sizes, N·M·T times per load; a generator under all() took 3x as long.
    if type(value) is list:
        for x in value:
            if type(x) is not int or x < 0:
                break
        else:
            return value
    raise CheckpointFormatError(f"{where}: expected a list of non-negative integers")


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise CheckpointFormatError(f"{where}: expected a string")
    return value


def decode_metadata(doc: object) -> Metadata:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointFormatError(f"checkpoint metadata is not in the {FORMAT} format")
    raw_sd = doc.get("state_dict_metadata")
    if not isinstance(raw_sd, dict):
        raise CheckpointFormatError("metadata.state_dict_metadata must be an object")
    sd: dict[str, Any] = {}
    for fqn, item in raw_sd.items():
        where = f"metadata of {fqn!r}"
        if not isinstance(item, dict):
            raise CheckpointFormatError(f"{where}: expected an object")
        if item.get("kind") == "bytes":
            sd[fqn] = BytesStorageMetadata()
            continue
        if item.get("kind") != "tensor":
            raise CheckpointFormatError(f"{where}: unknown kind {item.get('kind')!r}")
        mf = _MEMORY_FORMATS.get(str(item.get("memory_format")))
        if mf is None:
            raise CheckpointFormatError(f"{where}: unknown memory_format")
        chunks_raw = item.get("chunks")
        if not isinstance(chunks_raw, list):
            raise CheckpointFormatError(f"{where}: chunks must be a list")
        chunks = []
        for c in chunks_raw:
            if not isinstance(c, dict):
                raise CheckpointFormatError(f"{where}: chunk must be an object")
            chunks.append(
                ChunkStorageMetadata(
                    offsets=torch.Size(_ints(c.get("offsets"), where)),
                    sizes=torch.Size(_ints(c.get("sizes"), where)),
                )
            )
        sd[fqn] = TensorStorageMetadata(
            properties=TensorProperties(
                dtype=dtype_from_name(item.get("dtype"), where),
                requires_grad=bool(item.get("requires_grad", False)),
                memory_format=mf,
            ),
            size=torch.Size(_ints(item.get("size"), where)),
            chunks=chunks,
        )
    storage: dict[MetadataIndex, ShardRef] = {}
    raw_storage = doc.get("storage_data")
    if not isinstance(raw_storage, list):
        raise CheckpointFormatError("metadata.storage_data must be a list")
    for e in raw_storage:
        if not isinstance(e, dict):
            raise CheckpointFormatError("metadata.storage_data entries must be objects")
        fqn = _str(e.get("fqn"), "storage_data.fqn")
        where = f"storage of {fqn!r}"
        off = e.get("offset")
        idx = e.get("index")
        if idx is not None and not isinstance(idx, int):
            raise CheckpointFormatError(f"{where}: index must be an integer")
        index = MetadataIndex(fqn, None if off is None else _ints(off, where), idx)
        flen = e.get("file_offset")
        length = e.get("length")
        if not (isinstance(flen, int) and isinstance(length, int) and flen >= 0 and length >= 0):
            raise CheckpointFormatError(f"{where}: file_offset and length must be integers >= 0")
        dtype = e.get("dtype")
        shape = e.get("shape")
        if dtype is not None:
            dtype_from_name(dtype, where)
            shape_t = tuple(_ints(shape, where))
            numel = 1
            for s in shape_t:
                numel *= s
            if numel * DTYPES[dtype].itemsize != length:
                raise CheckpointFormatError(
                    f"{where}: {length} bytes do not hold a {dtype} tensor of shape {list(shape_t)}"
                )
        else:
            shape_t = None
        storage[index] = ShardRef(_str(e.get("file"), where), flen, length, dtype, shape_t)
    pd_raw = doc.get("planner_data")
    planner_data = None
    if isinstance(pd_raw, dict):
        planner_data = {
            k: tuple(v) for k, v in pd_raw.items() if isinstance(k, str) and isinstance(v, list)
        }
    sm_raw = doc.get("storage_meta")
    storage_meta = None
    if isinstance(sm_raw, dict):
        storage_meta = StorageMeta(
            checkpoint_id=sm_raw.get("checkpoint_id"),
            save_id=sm_raw.get("save_id"),
            load_id=sm_raw.get("load_id"),
            modules=[m for m in sm_raw.get("modules") or [] if isinstance(m, str)],
        )
    version = doc.get("version")
    return Metadata(
        state_dict_metadata=sd,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=storage_meta,
        version=version if isinstance(version, str) else None,
    )
