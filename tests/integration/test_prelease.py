"""Pre-leases with a real daemon and real ``async_save``: the next save's file is leased while this
one commits, so ``stage`` makes no daemon call; a pre-lease the daemon took back, or one that no
longer fits the state, sends the save back to a plain lease; every step loads back bit-exact."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _prelease

from helpers import DaemonProcess

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    _prelease.forget_all()
    yield
    _prelease.wait_asked()  # the last save's request for the next file, answered
    _prelease.forget_all()


def _state(seed: int, numel: int = MiB // 16) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": {f"t{i}": torch.randn(numel, generator=gen) for i in range(4)},
        "meta": {"seed": seed},
    }


def _blank(numel: int = MiB // 16) -> dict[str, Any]:
    return {"w": {f"t{i}": torch.zeros(numel) for i in range(4)}, "meta": {"seed": -1}}


class StageCalls:
    """The daemon calls each ``stage`` made (wrapping the client for the test)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[str]] = []
        self._inside: int | None = None  # the thread in stage (not the pre-lease's own)
        request, stage = DaemonClient._request, TieredStorageWriter.stage

        def traced_request(client: DaemonClient, method: str, path: str, *a: Any, **k: Any) -> Any:
            if self._inside == threading.get_ident():
                self.calls[-1].append(f"{method} {path}")
            return request(client, method, path, *a, **k)

        def traced_stage(writer: TieredStorageWriter, sd: dict[str, Any]) -> dict[str, Any]:
            self.calls.append([])
            self._inside = threading.get_ident()
            try:
                return stage(writer, sd)
            finally:
                self._inside = None

        monkeypatch.setattr(DaemonClient, "_request", traced_request)
        monkeypatch.setattr(TieredStorageWriter, "stage", traced_stage)


def _leased(client: DaemonClient) -> int:
    """The bytes the daemon has leased once this process's pre-lease requests are answered (each
    is asked for on a thread of its own while the save commits)."""
    _prelease.wait_asked()
    return client.status().leased_bytes


def _save_and_check(ns: str, step: int, sd: dict[str, Any]) -> TieredStorageWriter:
    writer = TieredStorageWriter(ns, step=step)
    dcp.async_save(sd, storage_writer=writer, no_dist=True).result()
    got = _blank(sd["w"]["t0"].numel())
    dcp.load(got, storage_reader=TieredStorageReader(ns, step=step), no_dist=True)
    for k, t in sd["w"].items():
        assert torch.equal(got["w"][k], t), f"step {step}: {k} differs"
    assert got["meta"] == sd["meta"]
    return writer


@pytest.mark.daemon_settings(keep_last=1)
def test_stage_asks_the_daemon_nothing_once_a_commit_frees_a_file(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    traced = StageCalls(monkeypatch)
    with DaemonClient() as client:
        for step in range(1, 6):
            _save_and_check("job", step, _state(step))
            # From step 2's commit on (it retires step 1), the next file waits, leased, for it.
            # (Step 1's commit frees nothing; its pre-lease exists only if the spare file the
            # daemon faults in during ramp-up was ready by then.)
            if step >= 2:
                assert _leased(client) == MiB, step
        assert [s.step for s in client.steps("job")] == [5]
    assert traced.calls[0]  # step 1 leased in stage
    assert traced.calls[2:] == [[], [], []]  # steps 3 to 5: no daemon call at all


@pytest.mark.daemon_settings(keep_last=1)
def test_the_commit_does_not_wait_for_the_next_file_and_the_next_stage_does(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next save's file is asked for on a thread of its own: a daemon slow to answer that
    request does not hold the save it follows (committed, loadable), and the next ``stage``
    waits for the answer and claims the file instead of leasing one."""
    delay = 3.0  # (under _prelease.ASKED_WAIT_S: the next stage waits it out)
    for step in (1, 2):
        _save_and_check("job", step, _state(step))
    _prelease.wait_asked()  # step 2's own request answered before the daemon turns slow
    lease = DaemonClient.lease

    def slow_pre_lease(client: DaemonClient, ns: str, rank: int, size: int, **kw: Any) -> Any:
        if kw.get("after") is not None:
            time.sleep(delay)
        return lease(client, ns, rank, size, **kw)

    monkeypatch.setattr(DaemonClient, "lease", slow_pre_lease)
    traced = StageCalls(monkeypatch)
    t0 = time.monotonic()
    _save_and_check("job", 3, _state(3))  # committed and loaded back while the ask sleeps
    assert time.monotonic() - t0 < delay
    # Step 4's stage came while the answer was still on its way: it waited for it and claimed
    # the file (without the wait it finds none and leases: a daemon call in stage).
    _save_and_check("job", 4, _state(4))
    assert traced.calls[1] == []


@pytest.mark.daemon_settings(keep_last=1)
def test_a_save_at_interpreter_shutdown_asks_for_the_next_file_on_its_own_thread(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save still writing while the interpreter shuts down (the script returned after its last
    ``async_save``) cannot start the asking thread: it asks on its own thread and commits."""

    class Refusing:  # what a ThreadPoolExecutor does once the interpreter is shutting down
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(_prelease, "_ask_pool", Refusing)
    traced = StageCalls(monkeypatch)
    for step in range(1, 5):
        _save_and_check("job", step, _state(step))
    assert traced.calls[2:] == [[], []]  # the pre-leases were still asked for, and claimed


@pytest.mark.daemon_settings(keep_last=1, capacity="3M")
def test_a_pre_lease_taken_back_under_pressure_sends_the_save_to_a_plain_lease(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    traced = StageCalls(monkeypatch)
    for step in (1, 2):
        _save_and_check("job", step, _state(step))
    with DaemonClient() as client:
        assert _leased(client) == MiB  # job's pre-lease
        # Another job needs 1.5 MiB; under 1 MiB is free and job's newest step must stay: the
        # daemon takes the pre-lease back rather than failing that save.
        other = client.lease("other", 0, 3 * MiB // 2)
        assert _leased(client) == 3 * MiB // 2
        assert [s.step for s in client.steps("job")] == [2]
        client.release("other", other.lease_id)
    _save_and_check("job", 3, _state(3))
    assert traced.calls[2], "step 3 should have leased its file in stage"
    _save_and_check("job", 4, _state(4))  # and the next one has its pre-lease again
    assert traced.calls[3] == []


@pytest.mark.daemon_settings(keep_last=1)
def test_a_state_that_changed_size_leases_a_new_file(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    traced = StageCalls(monkeypatch)
    for step in (1, 2):
        _save_and_check("job", step, _state(step))
    big = MiB // 8  # twice the size: the pre-lease won't do
    _save_and_check("job", 3, _state(3, numel=big))
    assert traced.calls[2]
    with DaemonClient() as client:
        # The unusable pre-lease was given back; step 3's commit freed no file of the new size.
        assert _leased(client) == 0
        _save_and_check("job", 4, _state(4, numel=big))
        assert _leased(client) == 2 * MiB  # step 3's file, for step 5
    _save_and_check("job", 5, _state(5, numel=big))
    assert traced.calls[3] and traced.calls[4] == []


@pytest.mark.daemon_settings(keep_last=1)
def test_prelease_off_leases_in_every_stage(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERCKPT_PRELEASE", "0")
    traced = StageCalls(monkeypatch)
    for step in (1, 2, 3):
        _save_and_check("job", step, _state(step))
    assert all(traced.calls)
    with DaemonClient() as client:
        assert _leased(client) == 0


@pytest.mark.daemon_settings(keep_last=1)
def test_a_daemon_that_ignores_after_leaves_no_lease_behind(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = DaemonClient.lease

    def old_daemon(client: DaemonClient, ns: str, rank: int, size: int, **kw: Any) -> Any:
        return lease(client, ns, rank, size)  # as a daemon without pre-leases answers: at once

    monkeypatch.setattr(DaemonClient, "lease", old_daemon)
    traced = StageCalls(monkeypatch)
    for step in (1, 2, 3):
        _save_and_check("job", step, _state(step))
        with DaemonClient() as client:  # the plain lease it got instead was given back
            assert _leased(client) == 0
    assert all(traced.calls)


def _process_mode_worker(rank: int, world: int, socket: str, out: str) -> None:
    """PROCESS-mode saves (DCP's helper process writes each one); the daemon calls each ``stage``
    of this trainer made, as JSON in ``out``."""
    import json
    import os

    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ["TIERCKPT_SOCKET"] = socket
    calls: list[list[str]] = []
    inside = [False]
    request, stage = DaemonClient._request, TieredStorageWriter.stage

    def traced_request(client: DaemonClient, method: str, path: str, *a: Any, **k: Any) -> Any:
        if inside[0]:
            calls[-1].append(f"{method} {path}")
        return request(client, method, path, *a, **k)

    def traced_stage(writer: TieredStorageWriter, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append([])
        inside[0] = True
        try:
            return stage(writer, sd)
        finally:
            inside[0] = False

    DaemonClient._request = traced_request  # type: ignore[method-assign]
    TieredStorageWriter.stage = traced_stage  # type: ignore[method-assign]
    for step in range(1, 5):
        sd = _state(step)
        writer = TieredStorageWriter("proc", step=step)
        kind = AsyncCheckpointerType.PROCESS
        dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind).result()
        got = _blank()
        dcp.load(got, storage_reader=TieredStorageReader("proc", step=step))
        for k, t in sd["w"].items():
            assert torch.equal(got["w"][k], t), f"step {step}: {k} differs"
    with open(out, "w") as f:
        json.dump(calls, f)


@pytest.mark.daemon_settings(keep_last=1)
def test_process_mode_stage_claims_the_file_the_helper_pre_leased(
    daemon: DaemonProcess, tmp_path: Any
) -> None:
    """In PROCESS mode DCP's helper process writes the save and asks for the next file; it hands
    the pre-lease to the trainer, whose next stage makes no daemon call."""
    import json

    from helpers import run_ranks

    out = tmp_path / "calls.json"
    run_ranks(_process_mode_worker, 1, str(daemon.socket), str(out))
    calls = json.loads(out.read_text())
    assert calls[0]  # step 1 leased in stage
    assert calls[2:] == [[], []], calls  # steps 3 and 4: no daemon call at all
