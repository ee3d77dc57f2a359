"""CUDA tensors (skipped without a CUDA device): asynchronous staging on a side stream into the
registered tier file, and a restore into CUDA tensors straight out of the tier mapping with the
blocks checked beside the DMA (``dcp/_device_copy``): bit-exact, the snapshot rule, and a bad
block failing the load (an explicit step) or falling back to the older step ("latest")."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _async_staging
from tierckpt_client.dcp._helpers import on_helpers
from tierckpt_core.errors import CheckpointFormatError, StagingRaceError

from helpers import DaemonProcess
from kit import flip_byte, step_paths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N = 3 << 20  # float32s: 12 MiB a tensor


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "a": torch.randn(N, device="cuda", generator=g),
        "b": torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16),
        "n": {"step": seed},
    }


def _blank() -> dict[str, Any]:
    return {
        "a": torch.zeros(N, device="cuda"),
        "b": torch.zeros(1000, device="cuda", dtype=torch.bfloat16),
        "n": {"step": -1},
    }


def _save(ns: str, step: int, sd: dict[str, Any], cfg: ClientConfig) -> None:
    res = dcp.async_save(
        sd,
        storage_writer=TieredStorageWriter(ns, step, config=cfg, async_staging=True),
        no_dist=True,
    )
    assert isinstance(res, AsyncSaveResponse)
    res.upload_completion.result(timeout=120)


def test_async_cuda_stage_snapshot_and_restore_bit_exact(daemon: DaemonProcess) -> None:
    cfg = ClientConfig.from_env(socket=daemon.socket)
    sd = _state(1)
    want = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    res = dcp.async_save(
        sd,
        storage_writer=TieredStorageWriter("gpu", 1, config=cfg, async_staging=True),
        no_dist=True,
    )
    assert isinstance(res, AsyncSaveResponse)
    res.staging_completion.result(timeout=60)
    sd["a"].add_(1)  # after staging_completion: never in the step
    res.upload_completion.result(timeout=120)
    out = _blank()
    r = TieredStorageReader("gpu", 1, config=cfg)
    dcp.load(out, storage_reader=r, no_dist=True)
    torch.cuda.synchronize()
    assert torch.equal(out["a"], want["a"]) and torch.equal(out["b"], want["b"])
    assert out["n"] == {"step": 1}


def test_a_kernel_changing_the_state_before_staging_completion_fails_the_save(
    daemon: DaemonProcess,
) -> None:
    cfg = ClientConfig.from_env(socket=daemon.socket)
    sd = _state(2)
    go, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        assert go.wait(60)

    on_helpers(_async_staging.ASYNC, 1, hold)
    assert started.wait(10)
    try:
        res = dcp.async_save(
            sd,
            storage_writer=TieredStorageWriter("gpu-race", 1, config=cfg, async_staging=True),
            no_dist=True,
        )
        sd["a"].mul_(2)  # launched before the stage even started
    finally:
        go.set()
    assert isinstance(res, AsyncSaveResponse)
    with pytest.raises(CheckpointException) as e:
        res.upload_completion.result(timeout=120)
    ((err, _),) = e.value.failures.values()
    assert isinstance(err, StagingRaceError)


def test_a_bad_block_fails_a_cuda_restore_and_latest_falls_back(client_env: DaemonProcess) -> None:
    cfg = ClientConfig.from_env(socket=client_env.socket)
    old, new = _state(3), _state(4)
    _save("gpu-bad", 1, old, cfg)
    _save("gpu-bad", 2, new, cfg)
    data = next(p for name, p in step_paths("gpu-bad", 2).items() if name.endswith(".data"))
    flip_byte(data, 5 << 20)  # inside tensor "a", whose DMA runs beside the check
    out = _blank()
    with pytest.raises(CheckpointException) as e:
        dcp.load(out, storage_reader=TieredStorageReader("gpu-bad", 2, config=cfg), no_dist=True)
    ((err, _),) = e.value.failures.values()
    assert isinstance(err, CheckpointFormatError) and "block" in str(err)
    out = _blank()
    r = TieredStorageReader("gpu-bad", config=cfg)
    dcp.load(out, storage_reader=r, no_dist=True)
    torch.cuda.synchronize()
    assert r.resolved_step == 1
    assert torch.equal(out["a"], old["a"]) and torch.equal(out["b"], old["b"])
