"""tierckpt_client.integrations.lightning: a Lightning FSDP2 run (ModelParallelStrategy, 2 gloo
ranks on CPU, the example script) saving every step through a real daemon, resumed with
``ckpt_path="last"`` bit for bit; and the strategies' argument checks and path mapping."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tierckpt_client import DaemonClient
from tierckpt_client.config import ClientConfig

from helpers import DaemonProcess, run_loop

# Lightning is imported inside the tests: collecting the suite does not pay its import time.

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_trainer.py"


def _states(
    node: DaemonProcess, namespace: str, until_durable: int | None = None
) -> dict[int, str]:
    """The steps the daemon lists for ``namespace`` and their states (once ``until_durable`` is
    durable, or after a minute)."""
    with DaemonClient(ClientConfig.from_env(socket=node.socket)) as c:
        deadline = time.monotonic() + 60
        while True:
            states = {s.step: s.state.value for s in c.steps(namespace)}
            if until_durable is None or states.get(until_durable) == "durable":
                return states
            if time.monotonic() > deadline:
                return states
            time.sleep(0.1)


@pytest.mark.slow
def test_fsdp2_sigterm_saves_durable_and_last_resumes_bit_exact(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """An uninterrupted 8-step FSDP2 run (the reference) keeps the newest 3 steps (save_top_k=3:
    the older ones are deleted from the daemon), every 3rd step durable. A second run gets
    SIGTERM on both ranks after step 3: Lightning stops fit, the strategy saves that step for the
    persistent tier and waits until it is durable, both ranks exit 0. The node then loses its
    memory; ckpt_path="last" resumes at that step from the persistent tier, and every later step
    prints the reference's loss."""
    import shutil
    import signal

    from tierckpt_client.integrations.lightning import read_pointer

    # keep_last above top-k: the removals seen are the strategy's, not the daemon's retention.
    store = tmp_path / "store"
    node = make_node(persist_url=f"file://{store}", keep_last=5)
    refdir = tmp_path / "ref"

    def argv(namespace: str, dirpath: Path, *more: str) -> list[str]:
        common = ["--steps", "8", "--top-k", "3"]
        return ["--namespace", namespace, "--dirpath", str(dirpath), *common, *more]

    # Regular steps of the second run stay in memory: only the save at SIGTERM asks for the
    # persistent tier.
    args = argv("job", tmp_path / "job", "--persist-every", "1000")
    ref = run_loop(
        EXAMPLE,
        argv("ref", refdir, "--persist-every", "3"),
        node.client_env,
        log_dir=tmp_path,
    )
    assert ref.returncodes == [0, 0], ref.lines
    assert ref.start == 0 and sorted(ref.losses) == list(range(1, 9)), ref.lines
    assert sorted(p.name for p in refdir.glob("*.ckpt")) == [
        "epoch=0-step=6.ckpt",
        "epoch=0-step=7.ckpt",
        "epoch=0-step=8.ckpt",
        "last.ckpt",
    ]
    assert read_pointer(refdir / "epoch=0-step=7.ckpt") == "tierckpt://ref/7"
    assert read_pointer(refdir / "last.ckpt") == "tierckpt://ref"
    # top-k removed steps 1-5 from memory; only steps 3 and 6 went to the persistent tier.
    states = _states(node, "ref", until_durable=6)
    assert states == {6: "durable", 7: "committed", 8: "committed"}, states
    assert sorted(p.name for p in (store / "ref").iterdir()) == [
        "step_000000000003",
        "step_000000000006",
    ]

    stopped = run_loop(
        EXAMPLE,
        [*args, "--step-time", "0.5"],
        node.client_env,
        log_dir=tmp_path,
        stop_after=3,
        stop_signal=signal.SIGTERM,
        signal_ranks=[0, 1],
    )
    assert stopped.returncodes == [0, 0], stopped.lines
    final = max(stopped.losses)
    assert final < 8, "the run was not stopped"
    states = _states(node, "job")
    assert states[final] == "durable", states
    assert all(v != "durable" for k, v in states.items() if k != final), states

    node.kill()
    shutil.rmtree(node.shm_dir)  # the node lost its memory: only the persistent tier is left
    node.start()
    resumed = run_loop(EXAMPLE, args, node.client_env, log_dir=tmp_path)
    assert resumed.returncodes == [0, 0], resumed.lines
    assert resumed.start == final, resumed.lines
    assert resumed.losses == {s: ref.losses[s] for s in range(final + 1, 9)}


@pytest.mark.slow
def test_ddp_checkpoint_io_resumes_from_a_given_step_bit_exact(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """DDP with TieredCheckpointIO (rank 0 saves the whole checkpoint): a 6-step run keeps the
    newest 3 steps; a second run started with ckpt_path="tierckpt://ddp/4" continues from step 4
    with the losses of the first."""
    from tierckpt_client.integrations.lightning import read_pointer

    dirpath = tmp_path / "ckpts"
    node = make_node(keep_last=5)
    args = ["--namespace", "ddp", "--strategy", "ddp", "--steps", "6", "--dirpath", str(dirpath)]
    ref = run_loop(EXAMPLE, [*args, "--top-k", "3"], node.client_env, log_dir=tmp_path)
    assert ref.returncodes == [0, 0], ref.lines
    assert sorted(ref.losses) == list(range(1, 7)), ref.lines
    with DaemonClient(ClientConfig.from_env(socket=node.socket)) as c:
        assert sorted(s.step for s in c.steps("ddp")) == [4, 5, 6]
    assert read_pointer(dirpath / "epoch=0-step=4.ckpt") == "tierckpt://ddp/4"
    resumed = run_loop(
        EXAMPLE, [*args, "--ckpt-path", "tierckpt://ddp/4"], node.client_env, log_dir=tmp_path
    )
    assert resumed.returncodes == [0, 0], resumed.lines
    assert resumed.start == 4, resumed.lines
    assert resumed.losses == {s: ref.losses[s] for s in (5, 6)}


def test_strategies_refuse_unsharded_checkpoints_and_bad_arguments() -> None:
    from tierckpt_client.integrations.lightning import (
        TieredFSDPStrategy,
        TieredModelParallelStrategy,
    )

    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        TieredModelParallelStrategy("job", save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="state_dict_type='full'"):
        TieredFSDPStrategy("job", state_dict_type="full")
    with pytest.raises(ValueError, match="persist_every"):
        TieredModelParallelStrategy("job", persist_every=0)
    with pytest.raises(ValueError, match="async_mode"):
        TieredFSDPStrategy("job", async_mode="fork")
    with pytest.raises(Exception, match="namespace"):
        TieredModelParallelStrategy("../job")


@pytest.mark.parametrize("name", ["TieredModelParallelStrategy", "TieredFSDPStrategy"])
def test_paths_map_to_steps_and_persist_cadence(name: str, tmp_path: Path) -> None:
    """What a ModelCheckpoint path becomes: a step id, or "latest" for last*.ckpt; which steps
    are saved for the persistent tier."""
    from tierckpt_client.integrations import lightning

    cls = getattr(lightning, name)
    strategy = cls("job", persist_every=4)
    assert strategy.namespace == "job"
    assert strategy._pointer_id(tmp_path / "epoch=0-step=12.ckpt", 12) == "tierckpt://job/12"
    assert strategy._pointer_id(tmp_path / "last-v1.ckpt", 12) == "tierckpt://job"
    assert [strategy._persist(s) for s in (3, 4, 8)] == [False, True, True]
    assert cls("job")._persist(4) is None  # the daemon's policy
    assert strategy._model_key == ("model" if cls is lightning.TieredFSDPStrategy else "state_dict")


def test_read_pointer_accepts_only_pointer_files(tmp_path: Path) -> None:
    from tierckpt_client.integrations.lightning import read_pointer

    good = tmp_path / "a.ckpt"
    good.write_text("tierckpt://job/5\n")
    assert read_pointer(good) == "tierckpt://job/5"
    other = tmp_path / "b.ckpt"
    other.write_bytes(b"PK\x03\x04" + b"\0" * 100)  # a torch.save zip file
    assert read_pointer(other) is None
    assert read_pointer(tmp_path / "missing.ckpt") is None
    assert read_pointer(tmp_path) is None  # a folder (Lightning's own sharded checkpoint)


def test_tierckpt_client_imports_no_integration() -> None:
    """The integrations are opt-in: ``import tierckpt_client`` loads neither them nor Lightning."""
    code = (
        "import sys, tierckpt_client; "
        "assert not [m for m in sys.modules if m.startswith(('lightning', "
        "'tierckpt_client.integrations'))], sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ckpt_paths_resolve_to_ids_or_to_lightnings_own_loading(tmp_path: Path) -> None:
    """ckpt_path: an id is itself, a pointer file the id it names, anything else None (loaded
    as Lightning loads it)."""
    import torch

    from tierckpt_client.integrations.lightning import TieredModelParallelStrategy

    strategy = TieredModelParallelStrategy("job")
    pointer = tmp_path / "epoch=0-step=5.ckpt"
    pointer.write_text("tierckpt://job/5\n")
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, plain)
    assert strategy._resolve("tierckpt://other/7") == "tierckpt://other/7"
    assert strategy._resolve(pointer) == "tierckpt://job/5"
    assert strategy._resolve(plain) is None


def test_a_pointer_to_another_namespace_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run with a misspelt namespace beside an old folder resumed from the other job's step
    (its last.ckpt names it) and saved into its own; only Lightning's "Restored all states" was
    said. An id passed on purpose is not warned about."""
    from tierckpt_client.integrations.lightning import TieredModelParallelStrategy

    last = tmp_path / "last.ckpt"
    last.write_text("tierckpt://lt-k2\n")
    strategy = TieredModelParallelStrategy("lt-typo")
    with caplog.at_level(logging.WARNING):
        assert strategy._resolve(last) == "tierckpt://lt-k2"
        assert strategy._resolve("tierckpt://lt-k2/4") == "tierckpt://lt-k2/4"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "a step of namespace 'lt-k2'; this run saves into namespace 'lt-typo'" in warning
    assert "ckpt_path='tierckpt://lt-typo'" in warning


def test_a_failed_save_is_raised_at_the_end_of_fit_not_while_another_error_unwinds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The seam only (a failed future in place of a save): the error of the save in flight is
    raised when fit ends; while fit is already failing, it is logged instead of masking that."""
    import logging
    from concurrent.futures import Future

    from tierckpt_client.integrations.lightning import (
        SaveFailedError,
        TieredModelParallelStrategy,
    )

    def failed() -> Future[None]:
        fut: Future[None] = Future()
        fut.set_exception(OSError("tier full"))
        return fut

    strategy = TieredModelParallelStrategy("job")
    strategy._inflight.start(5, failed())
    with pytest.raises(SaveFailedError, match="step 5 failed: tier full") as info:
        strategy._tiered_teardown()
    assert isinstance(info.value.__cause__, OSError)
    strategy._tiered_teardown()  # raised once, not again

    strategy._inflight.start(6, failed())
    strategy._tiered_exception(RuntimeError("boom"))
    with caplog.at_level(logging.ERROR):
        strategy._tiered_teardown()
    assert "the last save failed while another error unwound" in caplog.text


def test_checkpoint_io_takes_tensors_out_and_puts_them_back() -> None:
    """What TieredCheckpointIO stores besides the tensors loads with weights_only=True: the
    tensors' places are strings; each comes back where it was, containers as they were."""
    import io
    from collections import OrderedDict

    import torch

    from tierckpt_client.integrations._lightning_io import _put_tensors, _take_tensors

    w, m = torch.arange(6.0).reshape(2, 3), torch.ones(3)
    checkpoint = {
        "global_step": 4,
        "state_dict": OrderedDict([("w", w)]),
        "optimizer_states": [{"state": {0: {"exp_avg": m, "step": torch.tensor(4.0)}}}],
        "pair": (w, "x"),
    }
    tensors: list[torch.Tensor] = []
    rest = _take_tensors(checkpoint, tensors)
    assert len(tensors) == 4 and not any(t is w for t in checkpoint.values())
    buf = io.BytesIO()
    torch.save(rest, buf)
    buf.seek(0)
    back = _put_tensors(torch.load(buf, weights_only=True), dict(enumerate(tensors)))
    assert isinstance(back["state_dict"], OrderedDict) and back["state_dict"]["w"] is w
    assert back["optimizer_states"][0]["state"][0]["exp_avg"] is m
    assert back["pair"][0] is w and back["pair"][1] == "x" and back["global_step"] == 4


def test_checkpoint_io_refuses_bad_arguments() -> None:
    from tierckpt_client.integrations.lightning import TieredCheckpointIO

    with pytest.raises(ValueError, match="persist_every"):
        TieredCheckpointIO("job", persist_every=0)
    with pytest.raises(ValueError, match="async_mode"):
        TieredCheckpointIO("job", async_mode="fork")
    with pytest.raises(ValueError, match="namespace"):
        TieredCheckpointIO("job").save_checkpoint({"global_step": 1}, "tierckpt://other/1")


def test_checkpoint_io_never_unpickles_unverified_bytes(
    client_env: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's state besides the tensors is pickled into a uint8 tensor: a load with
    TIERCKPT_VERIFY_READS=0 (tensors unchecked) still verifies it, so a changed byte fails the
    load instead of reaching torch.load (weights_only=False runs what a pickle says)."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException

    from tierckpt_client.integrations.lightning import TieredCheckpointIO

    from kit import flip_byte

    saver = TieredCheckpointIO("lt-meta")
    w = torch.arange(64.0)
    saver.save_checkpoint(
        {"global_step": 3, "state_dict": {"w": w}, "note": "n" * 4096}, tmp_path / "a.ckpt"
    )
    saver.wait()
    with DaemonClient() as c:
        md = c.metadata("lt-meta", 3)
        (meta,) = [e for e in md["storage_data"] if e["fqn"] == "lightning"]
        pin = c.pin("lt-meta", 3)
        path = pin.paths[meta["file"]]
        c.unpin("lt-meta", 3, pin.pin_id)
    monkeypatch.setenv("TIERCKPT_VERIFY_READS", "0")
    loaded = TieredCheckpointIO("lt-meta").load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], w) and loaded["note"] == "n" * 4096

    flip_byte(path, meta["file_offset"] + meta["length"] // 2)
    with pytest.raises(CheckpointException) as info:
        TieredCheckpointIO("lt-meta").load_checkpoint(tmp_path / "a.ckpt", weights_only=False)
    (error,) = info.value.failures.values()
    assert f"file {meta['file']} does not match the checksum" in str(error), error
