"""Staged tensors cross into another process as references to the same file, not as copies."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import pickle
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._staging import stage_into, staging_size


def _child(payload: bytes, q: mp.Queue[object]) -> None:
    sd = pickle.loads(payload)
    w = sd["w"]
    hit = _arena.find(w.data_ptr(), w.numel() * w.element_size())
    q.put((w.sum().item(), hit is not None))
    w.fill_(7.0)  # writes through to the parent's file
    q.put("done")


def test_staged_state_dict_pickles_by_reference(tmp_path: Path) -> None:
    _arena.install_pickle_reducer()
    sd = {"w": torch.arange(1000, dtype=torch.float32).reshape(10, 100), "k": {"epoch": 3}}
    size = staging_size(sd)
    path = Path("/dev/shm") / f"tierckpt-unit-{os.getpid()}"
    try:
        with open(path, "wb") as f:
            f.truncate(size)
        staged = stage_into(sd, _arena.map_file(str(path))).state_dict
        sd["w"].zero_()  # the live tensor changes after staging; the staged copy does not
        payload = bytes(ForkingPickler.dumps(staged))
        assert len(payload) < 2000  # a reference, not 4000 bytes of data
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(payload, q))
        p.start()
        total, in_arena = q.get(timeout=60)
        assert q.get(timeout=60) == "done"
        p.join(60)
        assert total == float(sum(range(1000))) and in_arena
        assert torch.all(staged["w"] == 7.0)  # same pages in both processes
        assert staged["k"] == {"epoch": 3}
    finally:
        _arena.clear_cache()
        path.unlink(missing_ok=True)


def test_a_tier_path_that_is_a_link_or_not_a_file_is_never_mapped(tmp_path: Path) -> None:
    """A member of the daemon's group can put a link where a leased or pinned file was: mapping
    it read-write would write a save's bytes into whatever it points at. Refused, as is a path
    that is not a regular file; ``/proc/<pid>/fd/<fd>`` (a link by nature) is followed only
    when asked (PROCESS mode's hand-over)."""
    precious = tmp_path / "precious"
    precious.write_bytes(b"x" * 8192)
    link = tmp_path / "leased.bin"
    link.symlink_to(precious)
    with pytest.raises(OSError) as e:
        _arena.map_file(str(link))
    assert e.value.errno == errno.ELOOP
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError) as e:
        _arena.map_file(str(tmp_path / "fifo"))
    assert e.value.errno == errno.ENODEV
    fd = os.open(precious, os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            _arena.map_file(f"/proc/self/fd/{fd}")
        mapping = _arena.map_file(f"/proc/self/fd/{fd}", follow=True)
        assert bytes(mapping.buffer[:4].numpy()) == b"xxxx"
    finally:
        os.close(fd)
        _arena.clear_cache()
    assert precious.read_bytes() == b"x" * 8192
