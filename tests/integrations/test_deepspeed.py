"""tierckpt_client.integrations.deepspeed: DeepSpeed's own engine (ZeRO-1 and ZeRO-3, CPU, 2 gloo
ranks, examples/deepspeed_zero.py) saving a tag as one tierckpt step into a real daemon; fresh
ranks resume from ``latest`` with the next losses equal to the uninterrupted run's to the last bit,
and DeepSpeed's zero_to_fp32 rebuilds the model from the files ``materialize`` writes.
The engine's file format keeps a state dict's non-tensor structure exactly.

Needs DeepSpeed (``pip install -c constraints.txt -e '.[client,daemon,test,deepspeed]'``); skipped
without it."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the 'deepspeed' extra)")

from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from tierckpt_client import DaemonClient
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageWriter, _arena
from tierckpt_client.integrations.deepspeed import (
    install,
    join,
    materialize,
    read_file,
    split,
    tag_step,
)
from tierckpt_core.errors import CheckpointFormatError

from helpers import DaemonProcess, run_loop
from kit import step_paths, wait_durable

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepspeed_zero.py"


@pytest.fixture(scope="module")
def _shm_op_built() -> None:
    """DeepSpeed builds its CPU shared-memory op on first use (torch's JIT extension build: minutes
    on a loaded 2-core machine, again in every new venv), under a ``lock`` file that every later
    process waits on forever: a build killed half-way (a rank timed out) leaves it behind and
    every later run hangs. So: a lock older than any build here is such a leftover and is
    removed, saying so; and the op is built once here, with time for it, before the ranks start
    (their timeout is for training)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache/torch_extensions"))
    for lock in root.glob("**/deepspeed_shm_comm/lock"):
        if time.time() - lock.stat().st_mtime > 20 * 60:
            logging.getLogger(__name__).warning("removed a stale build lock: %s", lock)
            lock.unlink(missing_ok=True)
    build = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", build], env=env, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_file_comes_back_with_its_exact_structure() -> None:
    w = torch.randn(3, 4)
    sd = {
        "optimizer_state_dict": {
            "state": {0: {"exp_avg": w, "step": torch.tensor(3.0)}, 1: {}},
            "param_groups": [{"params": [0, 1], "lr": 0.1, "betas": (0.9, 0.99)}],
        },
        "module": OrderedDict([("a.weight", torch.nn.Parameter(w.clone())), ("same", w)]),
        "empty": {},
        "none": None,
        "ds_version": "0.19.8",
    }
    entries = split("f.pt", sd)
    assert isinstance(entries["f.pt/skeleton"], bytes)  # a bytes item: verified on every read
    back = join("f.pt", {k: v.clone() if torch.is_tensor(v) else v for k, v in entries.items()})
    assert list(back["optimizer_state_dict"]["state"]) == [0, 1]  # int keys stay ints
    assert back["optimizer_state_dict"]["state"][1] == {}
    assert back["empty"] == {} and back["none"] is None
    assert back["optimizer_state_dict"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert type(back["module"]) is OrderedDict
    assert isinstance(back["module"]["a.weight"], torch.nn.Parameter)
    assert torch.equal(back["module"]["same"], w)
    assert back["optimizer_state_dict"]["state"][0]["exp_avg"] is back["module"]["same"]


class _Planted:
    """Unpickling this creates a file: the proof that a replaced skeleton was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def test_a_replaced_skeleton_is_never_unpickled_with_tensor_checks_off(
    client_env: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone who can write into the tier directory replaces a file's skeleton in place with a
    pickle; with ``TIERCKPT_VERIFY_READS=0`` (tensor checks off) the read
    still fails on the checksum and nothing is unpickled."""
    entries = split("f.pt", {"w": torch.randn(4096), "note": "x" * 200, "n": {0: 1}})
    dcp.save(entries, storage_writer=TieredStorageWriter("ds-evil", 5), no_dist=True)
    assert read_file("ds-evil", 5, "f.pt")["note"] == "x" * 200  # intact: reads back
    marker = tmp_path / "marker"
    skeleton = entries["f.pt/skeleton"]
    # A bytes item is stored as DCP torch.save()s it (a zip); a tensor as its raw bytes.
    needle = b"PK\x03\x04" if isinstance(skeleton, bytes) else skeleton.numpy().tobytes()
    hits = 0
    for path in step_paths("ds-evil", 5).values():
        with open(path, "r+b") as f:
            at = f.read().find(needle)
            if at >= 0:
                f.seek(at)
                f.write(pickle.dumps(_Planted(str(marker))))
                hits += 1
    assert hits == 1
    monkeypatch.setenv("TIERCKPT_VERIFY_READS", "0")
    _arena.clear_cache()
    with pytest.raises(CheckpointException, match="does not match the checksum taken when"):
        read_file("ds-evil", 5, "f.pt")
    assert not marker.exists()


def test_install_refuses_what_is_not_a_deepspeed_engine() -> None:
    """Given the optimizer (or the model), DeepSpeed's own engine saved every checkpoint with
    torch.save, none reached tierckpt, and nothing said so."""
    with pytest.raises(TypeError, match=r"needs the DeepSpeedEngine that deepspeed\.initialize"):
        install(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), "ds-x")


def test_a_tag_without_a_number_is_refused_by_name() -> None:
    assert tag_step("global_step12") == 12
    with pytest.raises(CheckpointFormatError, match="'best'"):
        tag_step("best")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the first one may build DeepSpeed's op (_shm_op_built)
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_resumes_with_the_uninterrupted_runs_losses(
    stage: int,
    make_node: Callable[..., DaemonProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    _shm_op_built: None,
) -> None:
    # With a persistent tier: the tags are persisted by the daemon's policy, as every save (the
    # engine once asked for memory only, and no tag ever became durable).
    daemon = make_node(persist_url=f"file://{tmp_path / 'store'}")
    ns = f"ds-zero{stage}"
    env = {**daemon.client_env, "DS_ACCELERATOR": "cpu"}
    ckpt = tmp_path / "ckpt"
    common = ["--namespace", ns, "--ckpt", str(ckpt), "--zero-stage", str(stage), "--steps", "6"]
    full = run_loop(
        EXAMPLE, [*common, "--save-every", "3"], env, log_dir=tmp_path / "a", timeout=240
    )
    assert full.returncodes == [0, 0], full
    assert sorted(full.losses) == [1, 2, 3, 4, 5, 6], full
    assert (ckpt / "latest").read_text() == "global_step6"
    with DaemonClient(ClientConfig.from_env(socket=daemon.socket)) as c:
        assert [s.step for s in c.steps(ns)] == [3, 6]
    monkeypatch.setenv("TIERCKPT_SOCKET", str(daemon.socket))
    wait_durable(ns, {3, 6})
    # zero_to_fp32 (DeepSpeed's own) on the files materialize() writes: the whole fp32 model.
    export = tmp_path / "export"
    written = materialize(ns, "global_step6", export)
    assert all(p.stat().st_size > 1000 for p in written)  # real files, not pointers
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(export), tag="global_step6")
    assert {k: tuple(v.shape) for k, v in fp32.items()} == {
        "0.weight": (64, 16),
        "0.bias": (64,),
        "2.weight": (4, 64),
        "2.bias": (4,),
    }
    (ckpt / "latest").write_text("global_step3")  # as if the run had died after step 4
    resumed = run_loop(
        EXAMPLE,
        [*common[:-1], "7", "--save-every", "3", "--resume"],  # on to step 7
        env,
        log_dir=tmp_path / "b",
        timeout=240,
    )
    assert resumed.returncodes == [0, 0], resumed
    assert resumed.start == 3, resumed
    assert {s: resumed.losses[s] for s in (4, 5, 6)} == {s: full.losses[s] for s in (4, 5, 6)}
    # A replacement node: its node-local folder is empty. DeepSpeed alone finds no `latest`
    # there and starts from scratch; restore_folder writes it from tierckpt's newest step.
    fresh = tmp_path / "fresh"
    again = run_loop(
        EXAMPLE,
        ["--namespace", ns, "--ckpt", str(fresh), "--zero-stage", str(stage), "--steps", "7",
         "--save-every", "100", "--resume"],
        env,
        log_dir=tmp_path / "c",
        timeout=240,
    )  # fmt: skip
    assert again.returncodes == [0, 0], again
    assert again.start == 6 and (fresh / "latest").read_text() == "global_step6", again
    assert again.losses[7] == resumed.losses[7], again
