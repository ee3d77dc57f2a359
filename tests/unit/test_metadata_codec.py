"""DCP Metadata <-> JSON: lossless for what DCP writes, strict about what it reads."""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from tierckpt_client.dcp._metadata_codec import ShardRef, decode_metadata, decoded, encode_metadata
from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.metadata_blob import pack_metadata


def _metadata():  # type: ignore[no-untyped-def]
    sd = {
        "w": torch.randn(4, 3),
        "h": torch.ones(2, dtype=torch.bfloat16),
        "nested": {"k": torch.arange(3)},
        "extra": {"epoch": 2},
    }
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, StorageMeta(checkpoint_id="tierckpt://j/1"), True)
    plans, md = planner.create_global_plan([planner.create_local_plan()])
    storage = {}
    off = 0
    for item in plans[0].items:
        if item.tensor_data is not None:
            shape = tuple(item.tensor_data.chunk.sizes)
            dtype = str(item.tensor_data.properties.dtype).removeprefix("torch.")
            n = item.tensor_data.properties.dtype.itemsize * int(torch.Size(shape).numel())
            storage[item.index] = ShardRef("r0.data", off, n, dtype, shape)
        else:
            n = 10
            storage[item.index] = ShardRef("r0.extra", off, n)
        off += n
    md.storage_data = storage
    md.storage_meta = StorageMeta(checkpoint_id="tierckpt://j/1", save_id="s1")
    return md


def test_roundtrip_through_json_is_lossless() -> None:
    md = _metadata()
    doc = json.loads(json.dumps(encode_metadata(md)))
    back = decode_metadata(doc)
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.storage_data == md.storage_data
    assert back.planner_data == md.planner_data
    assert back.storage_meta.checkpoint_id == "tierckpt://j/1"
    assert isinstance(back.state_dict_metadata["extra.epoch"], BytesStorageMetadata)
    w = back.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata) and w.properties.dtype == torch.float32
    assert back.storage_data[MetadataIndex("h", (0,))].dtype == "bfloat16"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(format="pickle"), "not in the tierckpt-dcp-metadata/1 format"),
        (lambda d: d["state_dict_metadata"]["w"].update(dtype="object"), "unknown dtype 'object'"),
        (lambda d: d["state_dict_metadata"]["w"].update(size=[-1, 3]), "non-negative integers"),
        (lambda d: d["storage_data"][0].update(length=3), "do not hold a"),
        (lambda d: d["storage_data"][0].update(file_offset="0"), "must be integers"),
        (lambda d: d.update(storage_data={}), "storage_data must be a list"),
    ],
)
def test_malformed_metadata_is_rejected_with_the_field(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    doc = encode_metadata(_metadata())
    doc["storage_data"].sort(key=lambda e: e["dtype"] is None)  # a tensor entry first
    bad = copy.deepcopy(doc)
    mutate(bad)
    with pytest.raises(CheckpointFormatError, match=message):
        decode_metadata(bad)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_reader_decodes_the_packed_text_and_leaves_the_collector_as_it_found_it(
    enabled: bool,
) -> None:
    """The reader pauses the garbage collector while it decodes (it allocates per chunk of every
    tensor); a process's collector must come out as it went in, also when decoding fails."""
    md = _metadata()
    text = pack_metadata(encode_metadata(md))
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        back = decoded(text, where="j/step 1")
        assert back.state_dict_metadata == md.state_dict_metadata
        assert back.storage_data == md.storage_data
        assert gc.isenabled() == enabled
        bad = pack_metadata({**encode_metadata(md), "format": "tierckpt-dcp-metadata/0"})
        with pytest.raises(CheckpointFormatError, match="not in the tierckpt-dcp-metadata/1"):
            decoded(bad, where="j/step 1")
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


@pytest.mark.parametrize("value", [[1, True], [1, -1], [1.0], (1, 2), "12", None])
def test_chunk_offsets_must_be_lists_of_non_negative_integers(value: object) -> None:
    doc = encode_metadata(_metadata())
    doc["state_dict_metadata"]["w"]["chunks"][0]["offsets"] = value
    with pytest.raises(CheckpointFormatError, match="expected a list of non-negative integers"):
        decode_metadata(doc)
