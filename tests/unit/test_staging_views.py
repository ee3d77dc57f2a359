"""``FileMapping.tensor_at`` and ``placed``: the tensor staging copies into is exactly the bytes at its offset, of
its dtype and shape, for every dtype; ranges outside the file are refused."""

from __future__ import annotations

import mmap
from typing import Any

import pytest
import torch

from tierckpt_client.dcp._arena import FileMapping
from tierckpt_client.dcp._metadata_codec import DTYPES
from tierckpt_client.dcp._staging import align, stage_into
from tierckpt_core.errors import CheckpointFormatError

SIZE = 1 << 16


def _mapping() -> FileMapping:
    mm = mmap.mmap(-1, SIZE)
    return FileMapping(-1, -1, -1, SIZE, torch.frombuffer(mm, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", sorted(set(DTYPES.values()), key=str))
@pytest.mark.parametrize("shape", [(), (7,), (3, 1, 5), (2, 0, 3)])
def test_tensor_at_is_the_bytes_at_its_offset(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    m = _mapping()
    m.buffer.copy_(torch.randint(0, 256, (SIZE,), dtype=torch.uint8))
    for offset in (0, 64, 4096 + 128):
        t = m.tensor_at(offset, dtype, torch.Size(shape))
        n = t.numel() * dtype.itemsize
        assert t.dtype == dtype and tuple(t.shape) == shape and t.is_contiguous()
        if n:
            assert t.data_ptr() == m.base + offset
            got = t.reshape(-1).view(torch.uint8)
            assert torch.equal(got, m.buffer[offset : offset + n])


def test_tensor_at_refuses_bytes_beyond_the_file() -> None:
    m = _mapping()
    with pytest.raises(CheckpointFormatError, match="outside"):
        m.tensor_at(SIZE - 8, torch.float64, torch.Size((2,)))
    with pytest.raises(CheckpointFormatError, match="outside"):
        m.tensor_at(-64, torch.float32, torch.Size((1,)))


def _raw(m: FileMapping, t: torch.Tensor) -> bytes:
    """The bytes of the file under staged tensor ``t``."""
    at = t.data_ptr() - m.base
    return bytes(m.buffer[at : at + t.numel() * t.element_size()].numpy())


def _source(
    seed: int, layout: list[tuple[torch.dtype, tuple[int, ...]]]
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (dtype, shape) in enumerate(layout):
        b = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), generator=g)
        out[f"t{i}"] = b.to(torch.uint8).view(dtype).reshape(shape)
    return out


LAYOUT = [
    (torch.float32, (100,)),
    (torch.bfloat16, (3, 7)),
    (torch.int64, (5,)),
    (torch.uint8, (33,)),
]


def test_a_second_save_of_the_same_layout_reuses_its_tensors_and_lands_exact() -> None:
    """Staging into a file it staged into before, with the same layout, hands back the same
    tensor objects (no view made again), and each holds the new save's bytes."""
    m = _mapping()
    first = stage_into(_source(1, LAYOUT), m).state_dict
    src = _source(2, LAYOUT)
    second = stage_into(src, m).state_dict
    assert all(second[k] is first[k] for k in src)
    for k, t in src.items():
        assert _raw(m, second[k]) == bytes(t.reshape(-1).view(torch.uint8).numpy())
        assert second[k].dtype == t.dtype and second[k].shape == t.shape


def _changed(at: int, entry: tuple[torch.dtype, tuple[int, ...]]) -> list[Any]:
    out = list(LAYOUT)
    out[at] = entry
    return out


@pytest.mark.parametrize(
    "changed",
    [
        _changed(1, (torch.bfloat16, (7, 3))),
        _changed(1, (torch.float16, (3, 7))),
        _changed(0, (torch.float32, (117,))),
        [LAYOUT[1], LAYOUT[0], *LAYOUT[2:]],
    ],
    ids=["a-shape", "a-dtype", "a-size-shifts-the-rest", "reordered"],
)
def test_a_changed_layout_never_gets_a_tensor_of_the_old_one(
    changed: list[tuple[torch.dtype, tuple[int, ...]]],
) -> None:
    """Every staged tensor is exactly its source's dtype, shape and bytes, at the offset a fresh
    layout gives it, whatever the file held before; and the layout before still works after."""
    m = _mapping()
    for layout, seed in ((LAYOUT, 1), (changed, 2), (LAYOUT, 3)):
        src = _source(seed, layout)
        staged = stage_into(src, m).state_dict
        at = 0
        for k, t in src.items():
            s = staged[k]
            assert s.dtype == t.dtype and s.shape == t.shape and s.is_contiguous()
            assert s.data_ptr() - m.base == at
            assert _raw(m, s) == bytes(t.reshape(-1).view(torch.uint8).numpy())
            at += align(t.numel() * t.element_size())


def test_tensors_made_inside_inference_mode_take_a_later_save_outside_it() -> None:
    """A save inside ``torch.inference_mode()`` makes the file's tensors; a later save outside it
    copies into them in place (a transposed, non-contiguous source: ``copy_``), which torch refuses
    for a view made inside inference mode."""
    m = _mapping()
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        stage_into({"w": torch.randn(6, 4, generator=g)}, m)
    src = torch.randn(4, 6, generator=g).t()
    staged = stage_into({"w": src}, m).state_dict
    assert torch.equal(staged["w"], src)
