"""tierckpt_client.integrations.megatron with Megatron-Core's own code: a tiny GPTModel (local
spec, CPU initialization; examples/megatron_gpt.py) on 2 gloo ranks with real daemons. Every load
checks every weight against what was saved, to the last bit: sync and async saves (weights changed
right after an async save returned never reach the step), TP=2 saved and loaded at TP=1 with 2
pipeline stages (PP=2), Megatron's
fully-parallel save wrapper, a restore after a node (daemon and memory tier) is lost, and
"latest" after a save that died before its commit. (Megatron's fully-parallel *load* wrapper
exchanges shards on a CUDA device: not run here.)

Also Megatron-Core's ``CheckpointableShardedTensor`` (storage-less) through ``async_save`` with
``TieredStorageWriter`` in one process.

Needs megatron-core (docs/guides/megatron.md has the venv); skipped without it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the [megatron] extra)")

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.checkpointable import (
    CheckpointableShardedTensor,
)

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp._staging import staging_size
from tierckpt_client.integrations.megatron import load, save

from helpers import DaemonProcess, ring, run_loop
from kit import seal_bytes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt.py"
TOKEN = "peer-token-for-the-tests-0123456789"


def _run(args: list[str], env: dict[str, str], log_dir: Path) -> dict[str, Any]:
    run = run_loop(EXAMPLE, args, env, log_dir=log_dir, timeout=180)
    assert run.returncodes == [0, 0], run
    out: dict[str, Any] = json.loads(run.lines[-1])
    return out


def test_megatrons_sharded_tensors_async_save_bit_exact(client_env: DaemonProcess) -> None:
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sh = ShardedTensor.from_rank_offsets("w", full.clone(), replica_id=0)
    sd = {"w": CheckpointableShardedTensor.from_sh_ten(sh), "iteration": 5}
    assert staging_size(sd) == 128  # 8 x 6 bfloat16 = 96 bytes, aligned to 64
    fut = dcp.async_save(
        sd,
        storage_writer=TieredStorageWriter("mcore", 1),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        no_dist=True,
    )
    sh.data.add_(1)  # training goes on: never in the step
    fut.result()
    out = {"w": torch.zeros(8, 6, dtype=torch.bfloat16), "iteration": 0}
    dcp.load(out, storage_reader=TieredStorageReader("mcore", 1), no_dist=True)
    assert torch.equal(out["w"].view(torch.int16), full.view(torch.int16))
    assert out["iteration"] == 5


def test_a_checkpoint_id_without_a_step_is_refused_for_a_save() -> None:
    with pytest.raises(ValueError, match="needs a step"):
        save({}, "tierckpt://job")
    with pytest.raises(ValueError, match="tierckpt://"):
        load({}, "/some/folder")


def test_install_without_megatron_lm_names_what_is_missing() -> None:
    try:
        import megatron.training.checkpointing  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        pytest.skip("Megatron-LM is installed: tests/integrations/test_megatron_lm.py runs instead")
    from tierckpt_client.integrations import megatron_lm

    with pytest.raises(
        ModuleNotFoundError, match=r"megatron.training.*0\.19\.2.*megatron.save/load"
    ):
        megatron_lm.install("job")


def test_megatron_lm_async_saves_finalize_at_their_commit_in_order_and_failures_surface() -> None:
    """install()'s async bookkeeping (no Megatron-LM needed): Megatron-LM's finalize functions
    (its tracker write) run once a step is committed, never before an older save's, never for
    a failed one; the training thread's poll raises the failure, naming the step."""
    from concurrent.futures import Future

    from tierckpt_client.checkpointer import SaveFailedError
    from tierckpt_client.integrations.megatron import TieredSaveRequest
    from tierckpt_client.integrations.megatron_lm import _Request, _Saves

    saves = _Saves(timeout_s=5)
    tracker: list[int] = []
    futures = {step: Future[None]() for step in (1, 2, 3)}
    for step, fut in futures.items():
        req = _Request(TieredSaveRequest("job", step, fut))
        req.add_finalize_fn(lambda step=step: tracker.append(step))
        saves.schedule(req)
    futures[2].set_result(None)  # step 2 committed before step 1
    saves.finalize(blocking=False)
    assert tracker == [] and not saves.empty()
    futures[1].set_exception(RuntimeError("a node's daemon went away"))
    assert tracker == [2]  # step 1 failed: its tracker write never runs
    futures[3].set_result(None)
    assert tracker == [2, 3] and saves.empty()
    with pytest.raises(SaveFailedError, match=r"tierckpt://job/1.*daemon went away"):
        saves.finalize(blocking=False)
    saves.finalize(blocking=True)  # reported once; nothing left in flight


@pytest.mark.slow
def test_gpt_async_fully_parallel_tp2_to_tp1_pp2_and_latest_after_a_crash(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    ns = "gpt"
    # A save of step 5 that died before its commit: rank 0's file sealed, never committed.
    seal_bytes(daemon, ns, 5, uuid.uuid4().hex, 0, 4096)
    # Async save of step 1 at TP=2 through Megatron's fully-parallel wrapper (weights changed
    # after it returned), then "latest" loaded at TP=1 with 2 pipeline stages in the same ranks:
    # step 1, not step 5.
    args = ["--namespace", ns, "--tp", "2", "--save", "1", "--async", "--fully-parallel"]
    load = ["--load", "latest", "--load-tp", "1", "--load-pp", "2"]
    out = _run([*args, *load], daemon.client_env, tmp_path)
    assert out == {"saved": 1, "done": True, "loaded": 1, "exact": True}
    with DaemonClient.from_socket(daemon.socket) as c:
        states = {s.step: s.state for s in c.steps(ns)}
    assert states[1] != "writing" and states[5] == "writing", states


@pytest.mark.slow
def test_gpt_restores_bit_exact_after_a_node_is_lost(tmp_path: Path) -> None:
    nodes = ring(2, token=TOKEN, replicas=1, prefix="tierckpt-test", capacity="256M")
    try:
        for d in nodes:
            d.start()
        sockets = ",".join(str(d.socket) for d in nodes)
        common = ["--namespace", "gpt-nodes", "--tp", "2", "--sockets", sockets]
        out = _run([*common, "--save", "7"], {}, tmp_path / "a")  # a sync save
        assert out == {"saved": 7}
        for d in nodes:  # node B's share replicated to node A before B is lost
            with DaemonClient.from_socket(d.socket) as c:
                c.wait_replicated("gpt-nodes", 7, timeout_s=60)
        nodes[1].lose_node()
        nodes[1].start()
        out = _run([*common, "--load", "latest"], {}, tmp_path / "b")
        assert out == {"loaded": 7, "exact": True}
    finally:
        for d in nodes:
            d.cleanup()
