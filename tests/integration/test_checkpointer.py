"""``Checkpointer`` in one process against a real daemon: cadence, restore, errors surfacing."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt_client import Checkpointer, DaemonClient, SaveFailedError
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader

from helpers import DaemonProcess, free_port
from loopback_faults import SilentPeer


class _Counter:
    """A ``Stateful`` object: DCP calls its state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


def test_cadence_restore_and_stateful(client_env: DaemonProcess) -> None:
    counter = _Counter()
    w = torch.zeros(1000)
    with Checkpointer("ck", every=2, persist_every=4) as ckpt:
        assert ckpt.restore({"w": w, "counter": counter}) is None  # fresh start
        for step in range(1, 6):
            ckpt.wait_staged()  # the last save's stage is done: the loop may change w
            w += step
            counter.n = step
            ckpt.save(step, {"w": w, "counter": counter})
    with DaemonClient() as c:
        infos = {s.step: s for s in c.steps("ck")}
    assert sorted(infos) == [2, 4]  # only steps on the cadence were saved
    assert infos[4].persist is True and infos[2].persist is False

    w2, counter2 = torch.zeros(1000), _Counter()
    with Checkpointer("ck") as again:
        assert again.restore({"w": w2, "counter": counter2}) == 4
    assert counter2.n == 4
    assert torch.equal(w2, torch.full((1000,), float(1 + 2 + 3 + 4)))


def test_a_misspelt_namespace_starts_fresh_with_a_warning_naming_the_held_one(
    client_env: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    w = torch.ones(64)
    with Checkpointer("llama-pretrain") as ckpt:
        ckpt.save(3, {"w": w})
    caplog.set_level(logging.INFO, logger="tierckpt_client")
    # A resume under a typo starts again from scratch: said as a warning naming the namespace
    # the daemon holds, not as the INFO of a first run.
    with Checkpointer("llama-pretrian") as typo:
        assert typo.restore({"w": torch.zeros(64)}) is None
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, caplog.text
    assert "'llama-pretrain'" in warned[0].getMessage()
    assert "misspelt" in warned[0].getMessage()
    # A new run under a name like no other's is a first start: INFO only.
    caplog.clear()
    with Checkpointer("eval-sweep") as other:
        assert other.restore({"w": torch.zeros(64)}) is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "starting fresh" in caplog.text


@pytest.mark.parametrize("async_staging", [False, True])
def test_thread_saves_run_on_one_long_lived_thread(
    client_env: DaemonProcess, async_staging: bool
) -> None:
    """THREAD saves through the Checkpointer's own group run on one thread kept for them all
    (DCP's ``async_save`` starts a thread per save), and each is whole: three saves, each step
    kept read back bit-exact, and no thread left once the Checkpointer is closed."""
    seen: list[int] = []
    counter = _Counter()
    w = torch.zeros(1000)
    with Checkpointer(f"one-thread-{async_staging}", async_staging=async_staging) as ckpt:
        real = ckpt._save_staged

        def spy(*a: object) -> object:
            seen.append(threading.get_ident())
            return real(*a)  # type: ignore[arg-type]

        ckpt._save_staged = spy  # type: ignore[method-assign]
        for step in (1, 2, 3):
            ckpt.wait_staged()
            w.fill_(step)
            counter.n = step
            ckpt.save(step, {"w": w, "counter": counter})
        ckpt.wait()
    assert len(seen) == 3 and len(set(seen)) == 1 and seen[0] != threading.get_ident()
    assert not any(t.ident == seen[0] and t.is_alive() for t in threading.enumerate())
    for step in (2, 3):  # the daemon keeps the last two
        w2, c2 = torch.zeros(1000), _Counter()
        dcp.load(
            {"w": w2, "counter": c2},
            storage_reader=TieredStorageReader(f"one-thread-{async_staging}", step),
            no_dist=True,
        )
        assert torch.equal(w2, torch.full((1000,), float(step))) and c2.n == step


class _Unpicklable:
    """Non-tensor state is pickled by the save's background half (DCP bytes items): this object's
    pickling fails there, after ``save`` has returned."""

    def __deepcopy__(self, memo: dict[int, object]) -> _Unpicklable:
        return _Unpicklable()  # staging copies it

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("this object cannot be pickled")


def test_failed_save_surfaces_at_next_save_and_wait(client_env: DaemonProcess) -> None:
    good = {"w": torch.ones(100)}
    bad = {"w": torch.ones(100), "extra": {"obj": _Unpicklable()}}
    ckpt = Checkpointer("fail")
    ckpt.save(1, bad)  # returns: the failure happens in the background
    with pytest.raises(SaveFailedError, match="save of step 1 failed") as err:
        ckpt.save(2, good)
    assert "cannot be pickled" in str(err.value)
    ckpt.save(3, good)  # the error was reported once; the next save goes ahead
    ckpt.save(4, bad)
    with pytest.raises(SaveFailedError, match="step 4"):
        ckpt.wait()
    ckpt.close()
    with DaemonClient() as c:
        assert [s.step for s in c.steps("fail")] == [3]


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="async_mode"):
        Checkpointer("x", async_mode="fork")
    with pytest.raises(ValueError, match="every"):
        Checkpointer("x", every=0)
    # PROCESS mode's helper joins the process group: without one it failed at the first save,
    # inside torch, and took the interpreter down.
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"async_mode='process' needs torch.distributed"):
        Checkpointer("x", async_mode="process", handle_signals=False)


def test_extra_signal_saves_durable_step_and_exits_0(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """SIGUSR1 (the configured extra signal) only marks the process; the next save takes this
    step to the persistent tier, waits until it is durable, and exits with status 0."""
    store = tmp_path / "store"
    d = make_node(persist_url=f"file://{store}")
    config = ClientConfig.from_env(socket=d.socket)
    ckpt = Checkpointer("pre", persist_every=1000, config=config, preempt_signal=signal.SIGUSR1)
    w = torch.arange(1000.0)
    ckpt.save(1, {"w": w})
    os.kill(os.getpid(), signal.SIGUSR1)  # would end the process without the handler
    ckpt.wait_staged()
    w += 1
    with pytest.raises(SystemExit) as exited:
        ckpt.save(2, {"w": w})
    assert exited.value.code == 0
    with DaemonClient(config) as c:
        states = {s.step: s.state.value for s in c.steps("pre")}
    assert states == {1: "committed", 2: "durable"}
    assert (store / "pre" / "step_000000000002").is_dir()
    # The handlers are gone with the Checkpointer: the default action is back.
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_preemption_without_a_persistent_tier_exits_0_with_one_warning(
    client_env: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon has no persistent tier: the save that can be made (into the node's memory) is
    made, and the process exits 0, saying once where the step is."""
    ckpt = Checkpointer("pre-mem")
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        ckpt.save(5, {"w": torch.ones(10)})
    assert exited.value.code == 0
    with DaemonClient() as c:
        assert c.step("pre-mem", 5).state.value == "committed"
    warned = [r.getMessage() for r in caplog.records if "no persistent tier" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "pre-mem: preempted at step 5: the final save is in node memory" in warned[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_preemption_missing_the_deadline_exits_1(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, make_node: Callable[..., DaemonProcess]
) -> None:
    """A persistent tier is configured but the step cannot reach it within the deadline (uploads
    capped at 16 KiB/s, 32 MB to upload): the process exits 1, naming the deadline."""
    d = make_node(persist_url=f"file://{tmp_path / 'store'}", upload_max_rate="16K")
    config = ClientConfig.from_env(socket=d.socket)
    ckpt = Checkpointer("slow", config=config, preempt_deadline_s=2.0)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        ckpt.save(3, {"w": torch.ones(8_000_000)})
    assert exited.value.code == 1
    with DaemonClient(config) as c:
        assert c.step("slow", 3).state.value == "committed"
    assert "slow: step 3 not durable within the preemption deadline" in caplog.text
    assert "no persistent tier" not in caplog.text


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent-tier", "memory-only"])
def test_a_preemption_whose_replicas_cannot_come_ends_within_its_deadline(
    persistent: bool,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    make_node: Callable[..., DaemonProcess],
) -> None:
    """Where the daemon replicates, a preempted save waited for the step's replicas with the
    writer's own 300 s, before the deadline's clock even started, then failed "not
    checkpointed" and exited 1 with the step durable (a network-fault trial: 301.7 s for a
    20 s deadline; the ring's other node did not answer). With a persistent tier the deadline
    is the upload's now (the replicas go on unwaited): durable, exit 0. Without one the
    replicas are the step's only other copy: waited for within the deadline, and their
    absence is exit 1, said."""
    port = free_port()
    settings = {"persist_url": f"file://{tmp_path / 'store'}"} if persistent else {}
    with SilentPeer() as silent:
        d = make_node(
            port=port,
            host="127.0.0.1",
            node_name=f"127.0.0.1:{port}",
            peers=f"127.0.0.1:{port},{silent.address}",
            peer_token="preemption-replica-test-token-0123456789",
            replicas=1,
            peer_timeout_s=2,
            **settings,
        )
        config = ClientConfig.from_env(socket=d.socket)
        ckpt = Checkpointer("rep", config=config, preempt_deadline_s=6.0)
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.monotonic()
        with pytest.raises(SystemExit) as exited:
            ckpt.save(3, {"w": torch.ones(1000)})
        took = time.monotonic() - t0
    assert took < 6.0 + 10.0, f"the preempted save took {took:.0f} s"
    with DaemonClient(config) as c:
        state = c.step("rep", 3).state.value
    if persistent:
        assert exited.value.code == 0 and state == "durable"
        assert "rep: step 3 is durable" in caplog.text
        assert "not replicated" not in caplog.text
    else:
        assert exited.value.code == 1 and state == "committed"
        assert "rep/step 3 is committed, but not replicated within 6 s" in caplog.text


def test_resolve_chooses_the_step_of_the_next_load_only(client_env: DaemonProcess) -> None:
    """``resolve()`` (what a Checkpointer restore does first) fixes the step the next load
    reads, even if a newer one is committed in between; the load after that resolves again."""
    with Checkpointer("rs") as ckpt:
        ckpt.save(1, {"w": torch.full((64,), 1.0)})
        ckpt.wait()
        reader = TieredStorageReader("rs")
        assert reader.resolve() == 1
        ckpt.save(2, {"w": torch.full((64,), 2.0)})
        ckpt.wait()
    state = {"w": torch.zeros(64)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, storage_reader=reader)
    assert reader.resolved_step == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, storage_reader=reader)
    assert reader.resolved_step == 2 and torch.equal(state["w"], torch.full((64,), 2.0))
