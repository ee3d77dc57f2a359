"""Every dtype torch can store round-trips bit-exact (raw bytes plus the dtype's name), through a
plain save (copied in ``write_data``) and through ``async_save`` staging (copied in ``stage``); a
dtype whose bytes do not hold the tensor (quantized) is refused with an error that says why."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.errors import CheckpointFormatError

from helpers import DaemonProcess

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

QUANTIZED = (torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4)


def _dcp_can_plan(d: torch.dtype) -> bool:
    """DCP's own planner sizes items with this; it has no answer for the bits and sub-byte int
    dtypes, so no storage backend gets to see those."""
    try:
        torch._utils._element_size(d)
    except TypeError:
        return False
    return True


DTYPES = sorted(
    (
        d
        for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
        if isinstance(d, torch.dtype) and d not in QUANTIZED and _dcp_can_plan(d)
    ),
    key=str,
)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        for d in DTYPES:
            name = str(d).removeprefix("torch.")
            raw = torch.randint(0, 256, (3, 5 * d.itemsize), dtype=torch.uint8, generator=gen)
            if d == torch.bool:
                raw &= 1  # a bool's byte is 0 or 1
            out[name] = raw.view(d)  # arbitrary bit patterns, NaNs included
            out[name + "_rows"] = raw.view(d)[::2]  # a strided (non-contiguous) one
    return out


def _blank_like(sd: dict[str, Any]) -> dict[str, Any]:
    """Destinations of the same dtypes and shapes, every byte 0xAA (not what was saved)."""
    out = {}
    for k, v in sd.items():
        shape = (*v.shape[:-1], v.shape[-1] * v.dtype.itemsize)
        out[k] = torch.full(shape, 0xAA, dtype=torch.uint8).view(v.dtype)
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_storable_dtype_round_trips_bit_exact(client_env: DaemonProcess, mode: str) -> None:
    sd = _state()
    if mode == "sync":
        dcp.save(sd, storage_writer=TieredStorageWriter("dtypes", 1), no_dist=True)
    else:
        dcp.async_save(
            sd,
            storage_writer=TieredStorageWriter("dtypes", 1),
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            no_dist=True,
        ).result()
    out = _blank_like(sd)
    dcp.load(out, storage_reader=TieredStorageReader("dtypes", 1), no_dist=True)
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert _raw(out[k]) == _raw(v), k


def test_a_quantized_tensor_is_refused_with_the_reason(client_env: DaemonProcess) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"q": q}, storage_writer=TieredStorageWriter("dtypes", 2), no_dist=True)
    ((err, _),) = info.value.failures.values()  # (error, its traceback) per rank
    assert isinstance(err, CheckpointFormatError)
    assert "qint8 cannot be stored by tierckpt" in str(err) and "scale and zero point" in str(err)
