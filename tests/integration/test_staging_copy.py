"""``async_save`` staging copies host tensors as bytes in runs shared by the trainer's thread and
a pool (``_byte_copy``): every save stays bit-exact, whatever mix of tensors it gets (several runs
per tensor, views with conjugate or negative bits, non-contiguous ones, odd sizes), and the copy
never waits for a helper thread that was not scheduled."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client.dcp import (
    TieredStorageReader,
    TieredStorageWriter,
    _arena,
    _byte_copy,
    _helpers,
)
from tierckpt_client.dcp._arena import FileMapping
from tierckpt_client.dcp._staging import stage_into, staging_size
from tierckpt_core.errors import CheckpointFormatError

from helpers import DaemonProcess


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    big = _byte_copy.RUN + 37  # float32s: 4 runs and a ragged tail
    cplx = torch.randn(1000, dtype=torch.complex64, generator=gen)
    return {
        "model": {
            "w0": torch.randn(big, generator=gen),
            "w1": torch.randn(big // 2 + 3, generator=gen).to(torch.bfloat16),
            "w2": torch.randint(-100, 100, (257, 1031), dtype=torch.int8, generator=gen),
            "conj": cplx.conj(),  # contiguous, but its bytes are not the values
            "neg": torch._neg_view(torch.randn(999, generator=gen)),
            "rows": torch.randn(64, 1000, generator=gen)[::3],  # non-contiguous
            "t": torch.randn(300, 200, generator=gen).t(),
            "empty": torch.empty(0, 5),
            "scalar": torch.tensor(2.5),
        },
        "step": 7,
    }


def _exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.numel():
        return True
    raw = [x.contiguous().reshape(-1).view(torch.uint8) for x in (a, b)]
    return bool(torch.equal(*raw))


@pytest.fixture
def threads() -> Iterator[None]:
    """At least 2 of torch's threads in the test's thread (the copy uses as many), put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


def test_async_save_of_a_state_split_in_runs_is_bit_exact(
    client_env: DaemonProcess, threads: None
) -> None:
    sd = _state()
    assert staging_size(sd) >= 2 * _byte_copy.SPLIT_MIN  # the runs are shared over threads
    want = {k: v.clone() for k, v in sd["model"].items()}
    fut = dcp.async_save(
        sd,
        storage_writer=TieredStorageWriter("staging", 1),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        no_dist=True,
    )
    for v in sd["model"].values():  # training goes on while the save is written
        if v.numel() and not v.is_conj() and not v.is_neg():
            v.add_(1)
    fut.result()
    out = {
        "model": {k: torch.full_like(v.resolve_conj().resolve_neg(), 3) for k, v in want.items()},
        "step": 0,
    }
    dcp.load(out, storage_reader=TieredStorageReader("staging", 1), no_dist=True)
    for k, v in want.items():
        assert _exact(out["model"][k], v), k
    assert out["step"] == 7


def test_the_copy_does_not_wait_for_helpers_that_never_start() -> None:
    """Every helper thread is held: the trainer's thread copies every run itself, and returns."""
    release = threading.Event()
    held = [
        h.submit(lambda: release.wait(60))
        for h in _helpers._helpers(_helpers.STAGE, _helpers.helpers())
    ]
    try:
        src = torch.randint(0, 256, (3 * _byte_copy.SPLIT_MIN + 5,), dtype=torch.uint8)
        mm = mmap.mmap(-1, 4 * _byte_copy.SPLIT_MIN)
        mapping = FileMapping(-1, -1, -1, len(mm), torch.frombuffer(mm, dtype=torch.uint8))
        done = threading.Event()
        result: list[Any] = []

        def stage() -> None:
            torch.set_num_threads(4)  # (per thread) the trainer's thread and 3 helpers
            result.append(stage_into({"x": src}, mapping).state_dict)
            done.set()

        threading.Thread(target=stage, daemon=True).start()
        assert done.wait(60), "the copy waited for a helper that never started"
        assert torch.equal(result[0]["x"], src)
        assert not any(f.done() for f in held)  # the helpers were held all along
    finally:
        release.set()
        for f in held:
            f.result(timeout=60)
    # Once the helpers are free they find nothing left to copy: the staged bytes stay as copied.
    assert torch.equal(result[0]["x"], src)


def _staged_on(threads: int, sd: dict[str, Any], mapping: FileMapping) -> Any:
    """``stage_into`` with torch's thread count (which sizes the copy's helpers) at ``threads``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return stage_into(sd, mapping).state_dict
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_stage_into_lands_every_byte_on_any_number_of_threads(threads: int) -> None:
    sd = _state()
    size = staging_size(sd)
    mm = mmap.mmap(-1, size)
    mapping = FileMapping(-1, -1, -1, size, torch.frombuffer(mm, dtype=torch.uint8))
    staged = _staged_on(threads, sd, mapping)
    for k, v in sd["model"].items():
        assert _exact(staged["model"][k], v), k
        if v.numel():
            assert mapping.base <= staged["model"][k].data_ptr() < mapping.base + size, k


def test_small_tensors_are_copied_in_runs_of_many_and_land_bit_exact() -> None:
    # Thousands of small tensors: one run each made every tensor a hand-over between threads
    # (2048 tensors of 32 KiB copied slower over two threads than over one).
    run = _byte_copy.RUN
    pieces = [(i * 32768, 0, 32768) for i in range(2048)] + [(1 << 40, 0, 2 * run + 5)]
    runs = _byte_copy.runs_of(pieces)
    assert sorted(len(r) for r in runs) == [1, 1, 1] + [run // 32768] * (2048 * 32768 // run)
    big = [r for r in runs if len(r) == 1]
    assert [n for ((_, _, n),) in big] == [run, run, 5]
    assert [d for ((d, _, _),) in big] == [1 << 40, (1 << 40) + run, (1 << 40) + 2 * run]
    assert sorted(p for r in runs if len(r) > 1 for p in r) == pieces[:-1]

    gen = torch.Generator().manual_seed(11)
    sd = {f"t{i}": torch.randn(1000 + i % 7, generator=gen) for i in range(3000)}
    size = staging_size(sd)
    mm = mmap.mmap(-1, size)
    mapping = FileMapping(-1, -1, -1, size, torch.frombuffer(mm, dtype=torch.uint8))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        staged = stage_into(sd, mapping).state_dict
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(staged[k], v) for k, v in sd.items())


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("threads", [1, 2])
def test_small_tensors_of_every_dtype_beside_large_ones_land_bit_exact(threads: int) -> None:
    """Small tensors go to torch in runs (``_foreach_copy_``), large ones as bytes: side by side,
    of mixed dtypes and shapes (0-d, empty, odd sizes) and random bytes (NaN payloads, bools
    other than 0 and 1), all land bit-exact and where the staged tensor says, and the bytes
    between them stay untouched."""
    gen = torch.Generator().manual_seed(5)
    sd: dict[str, Any] = {}
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64]
    dtypes += [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
    for i in range(660):
        dtype = dtypes[i % len(dtypes)]
        shape = [(), (0,), (3, 7), (1000 + i,), (_byte_copy.SMALL_NUMEL - 1,)][i % 5]
        raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), generator=gen)
        sd[f"s{i}"] = raw.to(torch.uint8).view(dtype).view(shape)
    sd["big"] = torch.randn(3 * _byte_copy.SMALL_NUMEL, generator=gen)
    sd["nested"] = {"x": torch.randn(17, generator=gen).to(torch.float64)}
    size = staging_size(sd)
    mm = mmap.mmap(-1, size)
    mm.write(b"\xa5" * size)
    mapping = FileMapping(-1, -1, -1, size, torch.frombuffer(mm, dtype=torch.uint8))
    staged = _staged_on(threads, sd, mapping)
    used = torch.zeros(size, dtype=torch.bool)
    pairs = [(staged[k], v) for k, v in sd.items() if k != "nested"]
    pairs.append((staged["nested"]["x"], sd["nested"]["x"]))
    for i, (got, want) in enumerate(pairs):
        assert got.dtype == want.dtype and got.shape == want.shape, i
        assert torch.equal(_bytes_of(got), _bytes_of(want)), i
        if want.numel():
            at = got.data_ptr() - mapping.base
            used[at : at + want.numel() * want.element_size()] = True
    untouched = torch.frombuffer(mm, dtype=torch.uint8)[~used]
    assert bool((untouched == 0xA5).all())


@pytest.mark.parametrize("made_in", [True, False], ids=["file-in-inference", "file-outside"])
@pytest.mark.parametrize("staged_in", [True, False], ids=["save-in-inference", "save-outside"])
def test_small_tensors_stage_in_and_out_of_inference_mode(made_in: bool, staged_in: bool) -> None:
    """A tier file first mapped during a save inside ``torch.inference_mode()`` holds inference
    tensors; a later save outside it (and the reverse) still lands every small tensor (torch
    refuses in-place updates of inference tensors outside inference mode)."""
    gen = torch.Generator().manual_seed(3)
    sd = {f"t{i}": torch.randn(100 + i, generator=gen) for i in range(300)}
    sd["big"] = torch.randn(3 * _byte_copy.RUN // 4, generator=gen)  # the helpers run too
    size = staging_size(sd)
    mm = mmap.mmap(-1, size)
    with torch.inference_mode(made_in):
        mapping = FileMapping(-1, -1, -1, size, torch.frombuffer(mm, dtype=torch.uint8))
        _staged_on(2, sd, mapping)
    for v in sd.values():
        v.add_(1.0)
    with torch.inference_mode(staged_in):
        staged = _staged_on(2, sd, mapping)
    assert all(torch.equal(staged[k], v) for k, v in sd.items())


def test_a_tier_file_first_mapped_in_inference_mode_takes_later_saves(tmp_path: Any) -> None:
    """A save from inside ``torch.inference_mode()`` that maps a tier file first leaves it
    usable by the saves after it, outside inference mode: non-contiguous, bfloat16 and small
    tensors, every kind of copy into the file (torch refused in-place updates of the file's
    tensors when they were made in inference mode)."""
    gen = torch.Generator().manual_seed(4)
    sd = {"nc": torch.randn(64, 32, generator=gen).t(), "bf": torch.randn(9).to(torch.bfloat16)}
    sd.update({f"s{i}": torch.randn(100 + i, generator=gen) for i in range(100)})
    path = tmp_path / "tier-file"
    path.write_bytes(b"")
    os.truncate(path, staging_size(sd))
    try:
        with torch.inference_mode():
            _staged_on(2, sd, _arena.map_file(str(path)))
        for v in sd.values():
            v.add_(1)
        staged = _staged_on(2, sd, _arena.map_file(str(path)))  # the same mapping, cached
        assert all(torch.equal(staged[k], v) for k, v in sd.items())
    finally:
        _arena.clear_cache()


def test_a_stage_that_fails_midway_leaves_no_helper_writing_into_the_file() -> None:
    """Helpers start on the first tensors while the rest are laid out; when a later tensor
    fails, stage_into returns only once no helper is copying, and none copies after."""
    first = torch.randint(0, 256, (4 * _byte_copy.RUN,), dtype=torch.uint8)
    second = torch.randint(0, 256, (4 * _byte_copy.RUN,), dtype=torch.uint8)
    size = first.numel() + 64  # room for the first tensor only: the second one fails
    mm = mmap.mmap(-1, size)
    mapping = FileMapping(-1, -1, -1, size, torch.frombuffer(mm, dtype=torch.uint8))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(CheckpointFormatError, match="outside"):
            stage_into({"a": first, "b": second}, mapping)
    finally:
        torch.set_num_threads(before)
    landed = mapping.buffer.clone()
    # Every helper is idle: a task queued behind anything still running returns at once.
    for h in _helpers._helpers(_helpers.STAGE, _helpers.helpers()):
        h.submit(lambda: None).result(timeout=60)
    assert torch.equal(mapping.buffer, landed)


def test_staging_leaves_the_trainer_threads_cores_as_they_were() -> None:
    """Only the helpers' affinity is steered (off the trainer's core); the caller's never."""
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity calls on this platform")
    mine = os.sched_getaffinity(0)
    src = torch.randint(0, 256, (3 * _byte_copy.SPLIT_MIN,), dtype=torch.uint8)
    mm = mmap.mmap(-1, src.numel())
    mapping = FileMapping(-1, -1, -1, src.numel(), torch.frombuffer(mm, dtype=torch.uint8))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        staged = stage_into({"x": src}, mapping).state_dict
    finally:
        torch.set_num_threads(before)
    assert torch.equal(staged["x"], src)
    assert os.sched_getaffinity(0) == mine


def test_a_helper_task_cancelled_before_it_runs_never_runs() -> None:
    """A copy cancels the helpers' tasks that have not started when its own thread is done
    (tierckpt_core.verified_copy.copy_all): such a task must never run later."""
    release = threading.Event()
    kind = _helpers.VERIFY
    held = [h.submit(lambda: release.wait(60)) for h in _helpers._helpers(kind, 1)]
    ran: list[int] = []
    try:
        (late,) = _helpers.on_helpers(kind, 1, lambda: ran.append(1))
        assert late.cancel()
    finally:
        release.set()
        held[0].result(timeout=60)
    _helpers._helpers(kind, 1)[0].submit(lambda: None).result(timeout=60)  # the queue drained
    assert ran == []
