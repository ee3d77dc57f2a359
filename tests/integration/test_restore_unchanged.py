"""A load of a step this process loaded before, unchanged since, makes one request to its daemon
(the pin) and an unpin it does not wait for (issue 24, goal 2): ``read_metadata`` takes the
step's metadata from what it holds when the step's commit record in the tier directory is the
file the daemon's last answer named (a ``ReadStamp``). What a load reads is still verified
against the file records of the pin's answer: a step saved again, deleted or evicted between two
loads is read as it is now or fails the load, naming it; never read as it was; a flipped byte
still fails the load, naming file and block; and a stamp that lies (the directory is writable by
the node's trainers) costs a clear error at worst, never an old or unverified byte."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client import _reads
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader

from helpers import DaemonProcess, new_shm_dir, wait_until
from kit import blank_state, flip_byte, load, save, seeded_state, step_paths

N = 4096


@pytest.fixture(scope="module")
def _daemons() -> Iterator[dict[tuple[tuple[str, Any], ...], DaemonProcess]]:
    """The daemons of this module, one per set of settings, cleaned up at its end."""
    made: dict[tuple[tuple[str, Any], ...], DaemonProcess] = {}
    try:
        yield made
    finally:
        for d in made.values():
            d.cleanup()


@pytest.fixture
def daemon(
    request: pytest.FixtureRequest, _daemons: dict[tuple[tuple[str, Any], ...], DaemonProcess]
) -> DaemonProcess:
    """This module's daemon with the ``daemon_settings`` of the test (tests/conftest.py's
    fixture, started once per set of settings for the module rather than once per test): no
    test here stops it, and each test saves under namespaces of its own (a parametrized test's
    carry its parameter), so that none sees another's steps, stamps or pins."""
    marker = request.node.get_closest_marker("daemon_settings")
    key = tuple(sorted((dict(marker.kwargs) if marker else {}).items()))
    if key not in _daemons:
        _daemons[key] = DaemonProcess(new_shm_dir(), **dict(key)).start()
    return _daemons[key]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The ``POST .../reads`` requests this process sent a daemon (``pin`` or ``metadata``)."""
    made: list[str] = []
    real = DaemonClient._request

    def counted(self: DaemonClient, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        if path.endswith("/reads"):
            made.append("pin" if (args[0] if args else kwargs["body"])["pin"] else "metadata")
        return real(self, method, path, *args, **kwargs)

    monkeypatch.setattr(DaemonClient, "_request", counted)
    yield made


def test_a_step_loaded_before_and_unchanged_is_loaded_with_one_request(
    client_env: DaemonProcess, reads: list[str]
) -> None:
    save("same", 1, seeded_state(1, N))
    assert torch.equal(load("same", blank_state(N), 1)[1]["w"], seeded_state(1, N)["w"])
    assert reads == ["metadata", "pin"]
    reads.clear()
    for _ in range(2):
        _, out = load("same", blank_state(N), 1)
        assert torch.equal(out["w"], seeded_state(1, N)["w"])
        assert out["meta"] == {"step": 1}
    assert reads == ["pin", "pin"]
    # A save of another step leaves this one's record as it was.
    save("same", 2, seeded_state(2, N))
    reads.clear()
    assert torch.equal(load("same", blank_state(N), 1)[1]["w"], seeded_state(1, N)["w"])
    assert reads == ["pin"]


@pytest.mark.parametrize("layout", ["same", "other"])
def test_a_step_saved_again_between_two_loads_is_read_as_saved_again(
    client_env: DaemonProcess, reads: list[str], layout: str
) -> None:
    ns = f"again-{layout}"
    save(ns, 3, seeded_state(3, N))
    assert torch.equal(load(ns, blank_state(N), 3)[1]["w"], seeded_state(3, N)["w"])
    # Another layout: "a" first, so "w" sits at another offset of another file.
    new = seeded_state(3, N, seed=99)
    if layout == "other":
        new = {"a": torch.full((1000,), 7.0), **new}
    save(ns, 3, new)
    reads.clear()
    dest = {**({"a": torch.zeros(1000)} if layout == "other" else {}), **blank_state(N)}
    _, out = load(ns, dest, 3)
    assert torch.equal(out["w"], new["w"])
    if layout == "other":
        assert torch.equal(out["a"], new["a"])
    assert reads == ["metadata", "pin"]  # the old commit record is gone: asked again


def test_a_step_saved_again_while_an_old_reader_pins_it_is_read_as_saved_again(
    client_env: DaemonProcess,
) -> None:
    """The superseded attempt keeps its directory and files while a reader pins it; its commit
    record goes at once."""
    save("pinned", 4, seeded_state(4, N))
    load("pinned", blank_state(N), 4)
    with DaemonClient() as c:
        held = c.pin("pinned", 4)
        new = {"a": torch.full((1000,), 3.0), **seeded_state(4, N, seed=5)}
        save("pinned", 4, new)
        _, out = load("pinned", {"a": torch.zeros(1000), **blank_state(N)}, 4)
        c.unpin("pinned", 4, held.pin_id)
    assert torch.equal(out["w"], new["w"]) and torch.equal(out["a"], new["a"])


def test_a_step_deleted_between_two_loads_fails_the_load_naming_it(
    client_env: DaemonProcess,
) -> None:
    save("gone", 4, seeded_state(4, N))
    save("gone", 5, seeded_state(5, N))
    load("gone", blank_state(N), 5)
    with DaemonClient() as c:
        c.delete("gone", 5)
    dest = blank_state(N)
    with pytest.raises(CheckpointException, match=r"gone/step 5 is not committed"):
        load("gone", dest, 5)
    assert not dest["w"].any()  # nothing of the old bytes reached the tensor
    save("gone", 5, seeded_state(5, N, seed=11))  # and saved anew: the new bytes
    assert torch.equal(load("gone", blank_state(N), 5)[1]["w"], seeded_state(5, N, seed=11)["w"])


@pytest.mark.daemon_settings(keep_last=1)
def test_a_step_retired_between_two_loads_fails_the_load_naming_it(
    client_env: DaemonProcess,
) -> None:
    save("kept", 1, seeded_state(1, N))
    load("kept", blank_state(N), 1)
    save("kept", 2, seeded_state(2, N))  # keep_last=1: step 1 leaves memory
    with pytest.raises(CheckpointException, match=r"kept/step 1 is not committed"):
        load("kept", blank_state(N), 1)


def test_a_flipped_byte_fails_a_load_that_did_not_ask_for_the_metadata(
    client_env: DaemonProcess, reads: list[str]
) -> None:
    save("flip", 6, seeded_state(6, N))
    load("flip", blank_state(N), 6)
    data = next(p for name, p in step_paths("flip", 6).items() if name.endswith(".data"))
    flip_byte(data, 100)
    reads.clear()
    with pytest.raises(CheckpointException, match=r"file \S+ does not match the checksum.*block 0"):
        load("flip", blank_state(N), 6)
    assert reads == ["pin"]


@pytest.mark.parametrize("layout", ["same", "other"])
def test_a_stamp_that_lies_never_gives_old_bytes(
    client_env: DaemonProcess, reads: list[str], layout: str
) -> None:
    """The client is told the step is unchanged while it was saved again (a forged or reused
    commit record): DCP plans with the old metadata, and the pin's answer brings the new records.
    The same layout reads the new bytes, verified; another fails the load, naming the step."""
    ns = f"lie-{layout}"
    save(ns, 7, seeded_state(7, N))
    load(ns, blank_state(N), 7)
    key = (str(client_env.socket), ns, 7)
    old_version = _reads._STAMPS[key][0]
    new = seeded_state(7, N, seed=42)
    if layout == "other":
        new = {"a": torch.full((N,), 2.0), "w": new["w"][: N // 2], "meta": new["meta"]}
    save(ns, 7, new)
    with DaemonClient() as c:  # the record as it is now, filed under the old version
        stamp = c.open_read(ns, 7, pin=False).stamp
    assert stamp is not None
    _reads._STAMPS[key] = (old_version, stamp)
    reads.clear()
    dest = blank_state(N)
    if layout == "same":
        _, out = load(ns, dest, 7)
        assert torch.equal(out["w"], new["w"])
    else:
        with pytest.raises(CheckpointException, match=rf"{ns}/step 7 was saved again"):
            load(ns, dest, 7)
        assert not dest["w"].any()
    assert reads == ["pin"]


# -- the pin sent ahead (read_metadata sends the pin read_data claims) --------------------------


def _gone(paths: dict[str, str]) -> bool:
    return not any(os.path.exists(p) for p in paths.values())


def test_a_first_load_sends_its_pin_ahead_with_the_metadata_answer(
    client_env: DaemonProcess, reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step this process never read: ``read_metadata`` asks for the metadata and, as soon as
    it has the answer, sends the pin ``read_data`` claims (served while DCP plans); the bytes
    are verified against the records of the metadata's answer as before (a flipped byte fails)."""
    seen: list[list[str]] = []
    real = TieredStorageReader.read_metadata

    def read_metadata(self: TieredStorageReader) -> Any:
        out = real(self)
        seen.append(list(reads))
        return out

    monkeypatch.setattr(TieredStorageReader, "read_metadata", read_metadata)
    save("first", 1, seeded_state(1, N))
    assert torch.equal(load("first", blank_state(N), 1)[1]["w"], seeded_state(1, N)["w"])
    assert seen == [["metadata", "pin"]] and reads == ["metadata", "pin"]
    save("first", 2, seeded_state(2, N))
    data = next(p for name, p in step_paths("first", 2).items() if name.endswith(".data"))
    flip_byte(data, 100)
    with pytest.raises(CheckpointException, match=r"file \S+ does not match the checksum"):
        load("first", blank_state(N), 2)


def test_a_load_of_latest_has_the_steps_metadata_with_the_candidates(
    client_env: DaemonProcess, reads: list[str]
) -> None:
    """ "latest" in a process that never read the step: the daemon answers the candidates with the
    newest step's metadata and records, so the one request before DCP plans is the candidates'
    (then the pin, sent ahead); the bytes are verified against those records (a flipped byte
    fails the load, naming file and block, and the load falls back to the older step)."""
    save("newest", 1, seeded_state(1, N))
    save("newest", 2, seeded_state(2, N))
    step, out = load("newest", blank_state(N))
    assert step == 2 and torch.equal(out["w"], seeded_state(2, N)["w"])
    assert out["meta"] == {"step": 2}
    assert reads == ["pin"]
    with DaemonClient() as c:
        answer = c.candidates_read("newest")
    assert [x.step for x in answer.candidates] == [2, 1]
    assert answer.read is not None and answer.read.pin_id is None
    assert answer.read.files is not None and answer.read.metadata is not None
    save("newest", 3, seeded_state(3, N))
    data = next(p for name, p in step_paths("newest", 3).items() if name.endswith(".data"))
    flip_byte(data, 100)
    reads.clear()
    step, out = load("newest", blank_state(N))
    assert step == 2 and torch.equal(out["w"], seeded_state(2, N)["w"])


@pytest.mark.parametrize("layout", ["same", "other"])
def test_a_step_saved_again_after_the_candidates_answered_is_read_as_saved_again(
    client_env: DaemonProcess, reads: list[str], monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """The metadata that came with the candidates is of the step as it was then: saved again
    before the load reads it, the load asks for the metadata again and reads the new bytes."""
    ns = f"raced-{layout}"
    save(ns, 1, seeded_state(1, N))
    new = seeded_state(1, N, seed=7)
    if layout == "other":
        new = {"a": torch.full((1000,), 5.0), **new}
    real = DaemonClient.candidates_read

    def then_saved_again(self: DaemonClient, namespace: str, *args: Any) -> Any:
        answer = real(self, namespace, *args)
        assert answer.read is not None
        save(ns, 1, new)
        return answer

    monkeypatch.setattr(DaemonClient, "candidates_read", then_saved_again)
    reads.clear()
    dest = {**({"a": torch.zeros(1000)} if layout == "other" else {}), **blank_state(N)}
    step, out = load(ns, dest)
    assert step == 1 and torch.equal(out["w"], new["w"])
    if layout == "other":
        assert torch.equal(out["a"], new["a"])
    assert reads == ["metadata", "pin"]


def test_a_daemon_that_answers_the_candidates_alone_is_asked_for_the_metadata(
    client_env: DaemonProcess, reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon older than the candidates' read ignores ``read=true`` and answers the list: the
    load asks for the metadata itself, as before."""
    real = DaemonClient._request

    def older(self: DaemonClient, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        return real(self, method, path.replace("?read=true", ""), *args, **kwargs)

    monkeypatch.setattr(DaemonClient, "_request", older)
    save("older", 1, seeded_state(1, N))
    with DaemonClient() as c:
        answer = c.candidates_read("older")
    assert [x.step for x in answer.candidates] == [1] and answer.read is None
    step, out = load("older", blank_state(N))
    assert step == 1 and torch.equal(out["w"], seeded_state(1, N)["w"])
    assert reads == ["metadata", "pin"]


def test_a_new_step_of_the_layout_loaded_last_decodes_no_metadata(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of one layout share their metadata document: decoded once, for the first load."""
    import tierckpt_client.dcp._metadata_codec as codec

    decoded: list[str] = []
    real = codec.metadata_from_text

    def counted(doc: str, *, where: str) -> Any:
        decoded.append(where)
        return real(doc, where=where)

    monkeypatch.setattr(codec, "metadata_from_text", counted)
    monkeypatch.setattr(codec, "_DECODED", type(codec._DECODED)())  # as new
    for step in (1, 2, 3):
        save("layout", step, seeded_state(step, N))
        _, out = load("layout", blank_state(N), step)
        assert torch.equal(out["w"], seeded_state(step, N)["w"])
        assert out["meta"] == {"step": step}
    save("layout", 4, {"a": torch.full((8,), 4.0), **seeded_state(4, N)})  # another layout
    _, out = load("layout", {"a": torch.zeros(8), **blank_state(N)}, 4)
    assert torch.equal(out["a"], torch.full((8,), 4.0))
    assert decoded == ["layout/step 1", "layout/step 4"]


@pytest.mark.daemon_settings(keep_last=1)
@pytest.mark.parametrize("before", ["loaded before", "first load"])
def test_a_pin_sent_ahead_of_a_load_that_fails_in_planning_is_given_back(
    client_env: DaemonProcess, reads: list[str], before: str
) -> None:
    """DCP refuses the destination after ``read_metadata`` (another shape): the pin sent ahead
    is given back before this process's next request is served, so the next commit takes the
    step out of memory (keep_last=1) and its files with it."""
    ns = f"fail-{before.split()[0]}"
    save(ns, 1, seeded_state(1, N))
    if before == "loaded before":
        load(ns, blank_state(N), 1)
    paths = step_paths(ns, 1)
    reads.clear()
    with pytest.raises(CheckpointException, match="Size mismatch"):
        load(ns, blank_state(N // 2), 1)
    # The pin sent ahead by read_metadata, never claimed.
    assert reads == (["pin"] if before == "loaded before" else ["metadata", "pin"])
    save(ns, 2, seeded_state(2, N))
    assert _gone(paths)
    assert torch.equal(load(ns, blank_state(N), 2)[1]["w"], seeded_state(2, N)["w"])


@pytest.mark.daemon_settings(keep_last=1)
def test_a_pin_sent_ahead_for_a_reader_dropped_before_it_reads_is_given_back(
    client_env: DaemonProcess,
) -> None:
    save("probe", 1, seeded_state(1, N))
    load("probe", blank_state(N), 1)
    paths = step_paths("probe", 1)
    probe = TieredStorageReader("probe", 1)
    assert probe.read_metadata() is not None
    del probe
    gc.collect()
    save("probe", 2, seeded_state(2, N))
    assert _gone(paths)


EXITS = """
import sys
from kit import blank_state, load
load("exit", blank_state({n}), 1)
try:
    load("exit", blank_state({n} // 2), 1)  # fails in DCP's planning, after the pin went ahead
except BaseException as e:  # (CheckpointException is one)
    print("failed:", type(e).__name__)
"""


@pytest.mark.daemon_settings(keep_last=1)
def test_a_pin_sent_ahead_is_given_back_when_the_process_exits(
    client_env: DaemonProcess,
) -> None:
    save("exit", 1, seeded_state(1, N))
    paths = step_paths("exit", 1)
    tests = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", EXITS.format(n=N)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "failed: CheckpointException" in run.stdout, run.stderr[-3000:]
    save("exit", 2, seeded_state(2, N))
    assert _gone(paths)


def test_a_daemon_gone_between_two_loads_is_read_past_as_without_one(
    make_node: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's commit record outlives its daemon (the tier directory is its journal): a load
    after the daemon stopped still asks it in ``read_metadata``, and reads the persistent tier
    itself (``TIERCKPT_PERSIST_URL``) as a load without a daemon does."""
    url = f"file://{tmp_path / 'store'}"
    node = make_node(client=True, persist_url=url)
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", url)
    save("past", 1, seeded_state(1, N), persist=True)
    with DaemonClient() as c:
        wait_until("step 1 durable", lambda: c.step("past", 1).state.value == "durable")
    load("past", blank_state(N), 1)
    node.stop()
    _, out = load("past", blank_state(N), 1)
    assert torch.equal(out["w"], seeded_state(1, N)["w"])
