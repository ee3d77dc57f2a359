"""The reader's two ways out of a tier file: ``preadv`` straight into whole, contiguous destination
tensors when this process has not mapped the file (the first restore after a hydration or in a new
process), and a copy out of the file's mapping otherwise. Both must give the saved bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _arena

from helpers import DaemonProcess


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    return {
        "f32": torch.randn(1000, generator=gen),
        "bf16": torch.randn(17, 3, generator=gen).to(torch.bfloat16),
        "i64_scalar": torch.tensor(123456789012, dtype=torch.int64),
        "mask": torch.rand(5, generator=gen) > 0.5,
        "empty": torch.empty(0),
        "matrix": torch.randn(6, 4, generator=gen),
        "c64": torch.randn(3, 2, generator=gen, dtype=torch.complex64),
        "f16": torch.randn(2, 3, 5, generator=gen).to(torch.float16),
        "extra": {"step": 42, "tag": "paths"},
    }


def _zeros(sd: dict[str, Any], *, transposed_matrix: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {k: torch.zeros_like(v) for k, v in sd.items() if k != "extra"}
    if transposed_matrix:  # a non-contiguous destination: copied from the mapping
        out["matrix"] = torch.zeros(4, 6).t()
    out["extra"] = {"step": 0, "tag": ""}
    return out


def _check(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if k == "extra":
            assert got[k] == v
        else:
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("transposed", [False, True], ids=["pread", "mapping"])
def test_first_restore_in_a_process_reads_the_file_or_maps_it(
    client_env: DaemonProcess, transposed: bool
) -> None:
    sd = _state()
    dcp.save(sd, storage_writer=TieredStorageWriter("paths", 1), no_dist=True)
    _arena.clear_cache()  # as in a new process: no mapping of the step's file yet

    dest = _zeros(sd, transposed_matrix=transposed)
    dcp.load(dest, storage_reader=TieredStorageReader("paths", 1), no_dist=True)
    _check(dest, sd)
    assert not dest["matrix"].is_contiguous() if transposed else dest["matrix"].is_contiguous()
    # Whole contiguous tensors alone: nothing mapped. One that is not: the file is mapped.
    assert bool(_arena._by_identity) is transposed

    again = _zeros(sd)  # the mapping, if any, is used again; else the file is read again
    dcp.load(again, storage_reader=TieredStorageReader("paths", 1), no_dist=True)
    _check(again, sd)
