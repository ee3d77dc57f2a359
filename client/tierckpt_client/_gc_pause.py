"""Python's cyclic garbage collector paused while tierckpt works on the trainer's behalf: a stage
(the ``async_save`` stall), a load's read, the :class:`~tierckpt_client.Checkpointer`'s
whole load, and the planning of its background saves (not their commit, which may wait for
replicas, nor a degraded save's upload: minutes, and the trainer runs meanwhile).

A trainer's process holds hundreds of thousands of objects (torch's own, the model's), and DCP
with tierckpt allocates several objects per tensor (plan items, views, copies to land). With
thousands of tensors that started a young collection every few hundred tensors and, now and
then, a full one: measured on the 2-core box, a restore of 2048 tensors (64 MiB) ran 63
collections, and one load in three ran a full one that took ~300 ms of a ~600 ms load; with the
collector paused the same loads took ~350 ms (docs/benchmarks.md, "Thousands of tensors").
Paused, nothing is lost: reference counting frees what it always frees, the collections that
came due run at the first allocation after the pause (one instead of dozens), and a pause lasts
one stage, read, load or save planning, each bounded by its own timeouts.

The collector is process-wide: the first section to start disables it if it was enabled, the
last to end enables it again; a collector the user disabled stays disabled. A child forked
during a pause gets it enabled again. ``ClientConfig.pause_gc`` (``TIERCKPT_PAUSE_GC=0``)
turns the pause off.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # sections under way, in any thread
_ours = False  # this module disabled the collector (it was enabled when the first began)


@contextlib.contextmanager
def paused(on: bool = True) -> Iterator[None]:
    """The block runs with the cyclic collector off (``on``; see the module docstring)."""
    if not on:
        yield
        return
    global _depth, _ours
    with _lock:
        if _depth == 0 and gc.isenabled():
            gc.disable()
            _ours = True
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth = max(0, _depth - 1)  # (a child forked inside a section starts at 0)
            if _depth == 0 and _ours:
                _ours = False
                gc.enable()


def _after_fork_in_child() -> None:
    global _lock, _depth, _ours
    # The child has only the forking thread: the sections of the others never end there.
    if _ours:
        gc.enable()
    _lock, _depth, _ours = threading.Lock(), 0, False


os.register_at_fork(after_in_child=_after_fork_in_child)
