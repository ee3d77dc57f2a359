"""``FileMapping.tensor_at``: the tensor staging copies into is exactly the bytes at its offset, of
its dtype and shape, for every dtype; ranges outside the file are refused."""

from __future__ import annotations

import mmap

import pytest
import torch

from tierckpt_client.dcp._arena import FileMapping
from tierckpt_client.dcp._metadata_codec import DTYPES
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
