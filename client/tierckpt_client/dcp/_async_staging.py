"""Asynchronous staging: ``stage()`` returns a future, and the copy into the tier file runs while
the training loop goes on (torch's ``DefaultStager(StagingOptions(use_async_staging=True))``
protocol: ``async_save`` then returns an ``AsyncSaveResponse`` at once).

What stays in the trainer's thread, in ``stage()`` (:meth:`Marks.take`): one walk over the
state that deep-copies its non-tensor values (as a synchronous stage does: a dict the loop
changes later is not read again), notes each tensor's version counter, and, for CUDA tensors,
an event recorded
on the current stream of each device they are on (the point the copies must wait for: the
kernels the loop launched before the save). Everything else (the lease, the layout, the copies)
runs on one helper thread (:data:`ASYNC`, :mod:`_helpers`) through the same path as a
synchronous stage (``writer._stage_now`` → :func:`_staging.stage_into`): host tensors copied by
that thread and the staging helpers (:mod:`_byte_copy`); CUDA tensors copied on a side stream of
each device (made in the trainer's thread, as torch makes its staging stream there), which waits
for the event first and is synchronized at the end. The future is done when every byte is in the
tier file; the checksums are taken later, in ``write_data`` (DCP's save thread or process).

**The snapshot rule.** The save holds the values the tensors had when each was copied. So the
loop must not change them in place until ``staging_completion`` is done: wait for it before
``optimizer.step()`` (forward and backward only read the parameters; modules that update buffers
in their forward, such as BatchNorm in training mode, change state too: wait before that forward
then, or name those buffers in ``copied_at_stage``: ``stage()`` clones them itself before it
returns, as :class:`~tierckpt_client.Checkpointer` does with its modules' buffers). A value changed after ``staging_completion`` never reaches the step: the staged tensors
alias the tier file, and no thread writes into it once the future is done. A value changed
before is caught: :meth:`Marks.check` compares the version counters after the copy and fails the
save with :class:`~tierckpt_core.errors.StagingRaceError` naming the tensors (in-place ops move a
tensor's counter, also under ``no_grad``; changes through ``.data`` or through a shared numpy
array do not, and are not caught). :class:`~tierckpt_client.Checkpointer` waits for the loop
before every optimizer step (:func:`wait_before_optimizer_steps`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierckpt_client.dcp._checkpointable import is_checkpointable, local_tensors
from tierckpt_client.dcp._helpers import on_helpers
from tierckpt_core.errors import StagingRaceError

T = TypeVar("T")

ASYNC = "stage-async"
"""The helper kind that runs asynchronous stages, one at a time, in the order they were asked."""

_SIDE: dict[int, torch.cuda.Stream] = {}  # device index -> its staging stream
_SIDE_LOCK = threading.Lock()


def side_stream(device: int) -> torch.cuda.Stream:
    """The staging stream of CUDA ``device``, made on first use (from the trainer's thread)."""
    with _SIDE_LOCK:
        s = _SIDE.get(device)
        if s is None:
            s = _SIDE[device] = torch.cuda.Stream(device)
        return s


def storages(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    """The storages of ``tensors`` (their data pointers), as :meth:`Marks.take` knows them."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors if t.numel())


def _skeleton(
    obj: Any, path: str, out: list[tuple[str, torch.Tensor]], now: frozenset[int] = frozenset()
) -> Any:
    """``obj`` with every container rebuilt and every non-tensor leaf deep-copied, its tensors
    as they are (noted in ``out`` with their place in the state, as ``_staging._walk`` finds
    them): what the loop may change once ``stage()`` returned is in tensors only. A plain tensor
    whose storage is in ``now`` is cloned here instead (on the current stream for CUDA: the value
    in stream order, whatever the loop launches next), and the copy stages the clone."""
    if isinstance(obj, ShardedTensor):
        out.extend((path, s.tensor) for s in obj.local_shards())
        return obj
    if isinstance(obj, DTensor):
        out.append((path, obj._local_tensor))
        return obj
    if is_checkpointable(obj):  # a wrapper's own version and device say nothing of its shards
        out.extend((path, t) for _, t in local_tensors(obj))
        return obj
    if isinstance(obj, torch.Tensor):
        if now and obj.numel() and obj.untyped_storage().data_ptr() in now:
            obj = obj.detach().clone()
        out.append((path, obj))
        return obj
    if isinstance(obj, dict):
        return {
            k: _skeleton(v, f"{path}.{k}" if path else str(k), out, now) for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [
            _skeleton(v, f"{path}.{i}" if path else str(i), out, now) for i, v in enumerate(obj)
        ]
    return copy.deepcopy(obj)


FORWARD_BUFFER_MAX = 1 << 20
"""Buffers up to this size are copied by an asynchronous ``save`` itself (see ``Checkpointer``)."""


def forward_buffers(state: Any) -> list[torch.Tensor]:
    """The buffers (up to :data:`FORWARD_BUFFER_MAX` bytes each) of the modules in ``state``:
    its values, in nested dicts and lists, and one attribute deep in other objects (a
    ``Stateful`` wrapper holding ``self.model``)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.extend(b for b in obj.buffers() if b.nbytes <= FORWARD_BUFFER_MAX)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth + 1)
        elif depth == 1 and not isinstance(obj, torch.Tensor) and hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                if isinstance(v, nn.Module):
                    visit(v, depth + 1)

    visit(state, 0)
    return found


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return None


@dataclass
class Marks:
    """What ``stage()`` notes in the trainer's thread before the copy starts elsewhere."""

    versions: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    events: dict[int, torch.cuda.Event] = field(default_factory=dict)

    @classmethod
    def take(
        cls, state_dict: dict[str, Any], copy_now: frozenset[int] = frozenset()
    ) -> tuple[Marks, dict[str, Any]]:
        """The marks, and the state to stage (:func:`_skeleton`; tensors on the storages
        ``copy_now`` cloned here)."""
        found: list[tuple[str, torch.Tensor]] = []
        skeleton = _skeleton(state_dict, "", found, copy_now)
        marks = cls()
        devices = set()
        for path, t in found:
            v = _version(t)
            if v is not None:
                marks.versions.append((path, t, v))
            if t.device.type == "cuda":
                devices.add(t.device.index if t.device.index is not None else 0)
        for d in sorted(devices):
            side_stream(d)  # made here, in the trainer's thread
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            marks.events[d] = ev
        return marks, skeleton

    @contextlib.contextmanager
    def streams(self) -> Iterator[None]:
        """In the copying thread: each device's side stream current, after the trainer's event."""
        with contextlib.ExitStack() as stack:
            for d, ev in self.events.items():
                s = side_stream(d)
                stack.enter_context(torch.cuda.device(d))
                stack.enter_context(torch.cuda.stream(s))
                s.wait_event(ev)
            yield

    def check(self, where: str) -> None:
        """StagingRaceError if a tensor changed in place since :meth:`take`."""
        changed = [path or "<tensor>" for path, t, v in self.versions if _version(t) != v]
        if changed:
            shown = ", ".join(changed[:5]) + (
                f" and {len(changed) - 5} more" if changed[5:] else ""
            )
            raise StagingRaceError(
                f"{where}: {shown} changed in place while the asynchronous stage copied the "
                "state, so this save would hold a torn step and is not committed. Wait for "
                "staging_completion (Checkpointer.wait_staged()) before anything changes the "
                "state (optimizer.step(), a forward that updates buffers), or stage "
                "synchronously (async_staging=False)"
            )


def submit(fn: Callable[[], T]) -> Future[T]:
    """``fn`` on the asynchronous stager's thread (one save at a time, in order)."""
    return on_helpers(ASYNC, 1, fn)[0]


# -- the loop's side: wait before the optimizer changes the parameters ------------------------

_PENDING: list[Future[Any]] = []
_PENDING_LOCK = threading.Lock()
_HOOK: Any = None
WAIT_S = 3600.0
"""The bound on one wait for a stage (the copy of the largest shard at a fraction of memory
speed; a stage that takes longer has hung, and the wait says so)."""


def wait_staged(fut: Future[Any] | None, where: str) -> None:
    """Wait until ``fut`` (a ``staging_completion``) is done; its error is left to the save's
    own future (the save fails there, and the loop's caller raises it once)."""
    if fut is None or fut.done():
        return
    try:
        fut.exception(timeout=WAIT_S)
    except concurrent.futures.TimeoutError:
        raise StagingRaceError(
            f"{where}: the asynchronous stage did not finish within {WAIT_S:.0f} s"
        ) from None


def wait_before_optimizer_steps(fut: Future[Any]) -> None:
    """Have every ``torch.optim`` optimizer's ``step()`` wait for ``fut`` first. One global
    pre-step hook, installed once and kept (removing it from the thread that finishes a stage
    could change torch's table of hooks while the loop's thread walks it): with nothing pending
    it costs a lock and an empty list per step."""
    global _HOOK
    with _PENDING_LOCK:
        _PENDING.append(fut)
        if _HOOK is None:
            _HOOK = register_optimizer_step_pre_hook(_before_step)
    fut.add_done_callback(_done)


def _done(fut: Future[Any]) -> None:
    with _PENDING_LOCK:
        if fut in _PENDING:
            _PENDING.remove(fut)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    with _PENDING_LOCK:
        pending = list(_PENDING)
    for fut in pending:
        wait_staged(fut, f"{type(optimizer).__name__}.step()")
