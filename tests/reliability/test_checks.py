"""The reliability tests' checks (``_tiers``) catch what they claim to: a flipped byte or a missing
file in a committed or durable step, a lease or an attempt left behind. Without this, a harness
that finds nothing could be one that cannot see anything."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from tierckpt_client import DaemonClient
from tierckpt_core.layout import file_key
from tierckpt_core.protocol import CommitRequest, SealFile

from _tiers import durable_problems, leftovers, memory_problems, phases
from helpers import DaemonProcess
from kit import flip_byte


def test_the_checks_see_damage_and_leftovers(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    store = tmp_path / "persistent"
    url = f"file://{store}"
    d = make_node(persist_url=url)
    with DaemonClient.from_socket(d.socket) as c:
        assert phases(d.shm_dir) == {"between saves"}
        lease = c.lease("job", 0, 5000)
        with open(lease.path, "r+b") as f:
            f.write(os.urandom(5000))
        assert "stage/write (leased)" in phases(d.shm_dir)
        assert any("still leased" in x for x in leftovers(d))
        c.seal("job", 1, "a1", 0, [SealFile(lease_id=lease.lease_id, name="r0", length=5000)])
        assert "sealed, not committed" in phases(d.shm_dir)
        assert any("without a commit record" in x for x in leftovers(d))
        c.commit("job", 1, "a1", CommitRequest(files=["r0"], metadata={}, world_size=1))
        deadline = time.monotonic() + 30
        while durable_problems(url, "job")[0] < 1:
            assert time.monotonic() < deadline, "step 1 never became durable"
            time.sleep(0.1)
        assert memory_problems(d, "job") == []
        assert durable_problems(url, "job") == (1, [])
        assert leftovers(d) == []

        pin = c.pin("job", 1)
        c.unpin("job", 1, pin.pin_id)
        flip_byte(Path(pin.paths["r0"]), 4321)
        assert any("bytes differ" in x for x in memory_problems(d, "job"))
        flip_byte(store / file_key("job", 1, "r0"), 17)
        assert any("bytes differ" in x for x in durable_problems(url, "job")[1])
        (store / file_key("job", 1, "r0")).unlink()
        assert durable_problems(url, "job")[1]
