"""Megatron-LM's ``save_checkpoint``/``load_checkpoint`` with tierckpt steps: :func:`install`.

Megatron-LM (``megatron.training``, in the megatron-core 0.19.2 wheel; not in 0.16.1) saves step
``N`` of a ``torch_dist`` checkpoint into the folder ``<--save>/iter_000000N`` and records it in
``<--save>/latest_checkpointed_iteration.txt`` (the *tracker*). After::

    from tierckpt_client.integrations import megatron_lm
    megatron_lm.install("my-job")        # every rank, before training (or: with ...: as a context)

the folder ``iter_000000N`` stands for the step ``tierckpt://my-job/N``: Megatron-LM's own
``save_checkpoint`` (sync or ``--async-save``) and ``load_checkpoint`` store into and restore
from tierckpt through :mod:`tierckpt_client.integrations.megatron`. What is patched (module
attributes of ``megatron.training``; each restored by :meth:`Installed.uninstall`):

* ``checkpointing.dist_checkpointing``: a stand-in for ``megatron.core.dist_checkpointing``
  whose ``save``/``load``/``load_common_state_dict``/``check_is_distributed_checkpoint`` send a
  folder ``iter_N`` without Megatron's ``metadata.json`` to the step (nothing listed, no
  ``metadata.json`` written, the common state read from the step, not with ``FileSystemReader``);
  everything else, and a real on-disk checkpoint (``metadata.json`` present), stays Megatron's.
* ``checkpointing._get_checkpoint_format``: ``torch_dist`` for such a folder without listing it
  (the folder may be on a node that is gone).
* ``checkpointing.read_metadata``: "latest" is tierckpt's newest committed step (decided on rank 0,
  broadcast on gloo), whatever step the tracker names; a ``release`` tracker, a ``--ckpt-format``
  other than ``torch_dist``, and a namespace with no committed step (then the tracker's step, max
  over the ranks) stay as Megatron's.
* ``schedule_async_save``/``is_empty_async_queue`` (in ``checkpointing`` and ``async_utils``) and
  ``maybe_finalize_async_save`` (in ``async_utils`` and ``training``): an async save is done when
  its step is committed on every node; the functions Megatron-LM adds to the request (the
  tracker write, its logging) then run in the save's own thread, in the order of the saves, and
  only for a committed step. The training thread's poll checks that and raises
  :class:`~tierckpt_client.checkpointer.SaveFailedError` for a save that failed. Megatron's
  ``AsyncCallsQueue`` (which all-reduces on a CUDA device) is not used for these saves.

So the tracker is written only once its step is committed, sync or async. The empty folder
``iter_N`` that Megatron-LM's ``save_checkpoint`` creates before a save stays (it is Megatron's).
Ignored for a tierckpt step: Megatron's cached save plans (``--ckpt-assume-constant-structure``),
``--verify-integrity`` (tierckpt checks every byte's checksum on each read), ``--async-strategy``
and ``--dist-ckpt-workers``. ``--ckpt-fully-parallel-save``/``-load`` keep Megatron's wrappers.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling

from tierckpt_client.checkpointer import SaveFailedError, checkpoint_groups
from tierckpt_client.dcp import TieredStorageReader
from tierckpt_client.dcp.ids import format_checkpoint_id, parse_checkpoint_id
from tierckpt_client.integrations import megatron as mcore
from tierckpt_core.errors import StepNotFoundError

__all__ = ["Installed", "install", "step_of"]

logger = logging.getLogger(__name__)

_ITER_DIR = re.compile(r"iter_(\d+)")
_MEGATRON_METADATA = "metadata.json"  # what marks a folder as Megatron's own on-disk checkpoint


def step_of(checkpoint_dir: Any) -> int | None:
    """The step a Megatron-LM checkpoint folder stands for (``.../iter_0000100`` -> 100), or None
    for any other path and for a real on-disk checkpoint (one with Megatron's ``metadata.json``)."""
    path = Path(str(checkpoint_dir))
    m = _ITER_DIR.fullmatch(path.name)
    if m is None or (path / _MEGATRON_METADATA).is_file():
        return None
    return int(m.group(1))


class _Request:
    """What the patched ``dist_checkpointing.save`` hands Megatron-LM for an async save: the
    save in flight and the functions Megatron-LM adds (``add_finalize_fn``), run at the commit."""

    def __init__(self, request: mcore.TieredSaveRequest):
        self.request = request
        self.finalize_fns: list[Any] = []

    def add_finalize_fn(self, fn: Any) -> None:
        self.finalize_fns.append(fn)


class _Saves:
    """The async saves in flight, oldest first. Each one's finalize functions run once it is
    committed (in the thread that saw the commit), oldest first; failures are kept for the
    training thread's next poll."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pending: collections.deque[_Request] = collections.deque()
        self._errors: list[BaseException] = []

    def schedule(self, req: _Request) -> None:
        with self._lock:
            self._pending.append(req)
        req.request.add_done_callback(self._drain)

    def empty(self) -> bool:
        with self._lock:
            return not self._pending

    def _drain(self, *_: Any) -> None:
        with self._lock:
            while self._pending and self._pending[0].request.done():
                req = self._pending.popleft()
                try:
                    req.request.result(0)
                except SaveFailedError as e:
                    logger.error("%s", e)
                    self._errors.append(e)
                    continue
                for fn in req.finalize_fns:  # Megatron-LM's: the tracker, logging
                    try:
                        fn()
                    except Exception as e:
                        logger.exception("%s: a finalize function failed", req.request)
                        self._errors.append(e)

    def finalize(self, blocking: bool) -> None:
        """Megatron-LM's ``maybe_finalize_async_save``: without ``blocking`` a local check, no
        wait; with it, wait (at most ``timeout_s``) for every save in flight. Raises the first
        failure since the last call."""
        if blocking:
            deadline = time.monotonic() + self.timeout_s
            with self._lock:
                pending = list(self._pending)
            for req in pending:
                with contextlib.suppress(SaveFailedError):  # kept by _drain, raised below
                    req.request.result(max(0.0, deadline - time.monotonic()))
        self._drain()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]
        if blocking and not self.empty():
            raise TimeoutError(f"an async save is not committed after {self.timeout_s} s")


class _DistCheckpointing:
    """``megatron.core.dist_checkpointing`` as Megatron-LM's checkpointing module sees it once
    installed: a folder ``iter_N`` (no ``metadata.json``) is the step ``tierckpt://ns/N``."""

    def __init__(self, real: Any, namespace: str, persist: bool | None):
        self._real = real
        self._namespace = namespace
        self._persist = persist

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _id(self, checkpoint_dir: Any) -> str | None:
        step = step_of(checkpoint_dir)
        return None if step is None else format_checkpoint_id(self._namespace, step)

    def check_is_distributed_checkpoint(self, checkpoint_dir: Any) -> bool:
        if self._id(checkpoint_dir) is not None:
            return True
        return bool(self._real.check_is_distributed_checkpoint(checkpoint_dir))

    def load_common_state_dict(self, checkpoint_dir: Any) -> Any:
        ckpt = self._id(checkpoint_dir)
        if ckpt is None:
            return self._real.load_common_state_dict(checkpoint_dir)
        namespace, step = parse_checkpoint_id(ckpt)
        assert step is not None
        return mcore._load_common(namespace, step)

    def save(
        self,
        sharded_state_dict: Any,
        checkpoint_dir: Any,
        sharded_strategy: Any = None,
        validate_access_integrity: bool = True,
        async_sharded_save: bool = False,
        preprocess_common_before_consistancy_check: Any = None,
        content_metadata: dict[str, Any] | None = None,
        **ignored: Any,  # async_strategy, verify_integrity: see the module's docstring
    ) -> _Request | None:
        ckpt = self._id(checkpoint_dir)
        if ckpt is None:
            return self._real.save(
                sharded_state_dict,
                checkpoint_dir,
                sharded_strategy,
                validate_access_integrity,
                async_sharded_save,
                preprocess_common_before_consistancy_check,
                content_metadata,
                **ignored,
            )
        fully_parallel = isinstance(sharded_strategy, FullyParallelSaveStrategyWrapper)
        req = mcore.save(
            sharded_state_dict,
            ckpt,
            async_=async_sharded_save,
            fully_parallel=fully_parallel,
            parallelization_group=(
                sharded_strategy.parallelization_group if fully_parallel else None
            ),
            persist=self._persist,
            validate_access_integrity=validate_access_integrity,
            content_metadata=content_metadata,
            preprocess_common=preprocess_common_before_consistancy_check,
        )
        return None if req is None else _Request(req)

    def load(
        self,
        sharded_state_dict: Any,
        checkpoint_dir: Any,
        sharded_strategy: Any = None,
        validate_access_integrity: bool = True,
        strict: Any = StrictHandling.ASSUME_OK_UNEXPECTED,
        **ignored: Any,  # verify_integrity, process_group
    ) -> Any:
        ckpt = self._id(checkpoint_dir)
        if ckpt is None:
            return self._real.load(
                sharded_state_dict,
                checkpoint_dir,
                sharded_strategy,
                validate_access_integrity,
                strict,
                **ignored,
            )
        fully_parallel = isinstance(sharded_strategy, FullyParallelLoadStrategyWrapper)
        return mcore.load(
            sharded_state_dict,
            ckpt,
            fully_parallel=fully_parallel,
            parallelization_group=(
                sharded_strategy.parallelization_group if fully_parallel else None
            ),
            strict=strict,
            validate_access_integrity=validate_access_integrity,
        )


def _newest_step(namespace: str, tracker: str, original: Any) -> tuple[int, bool]:
    """``read_metadata`` once installed: (tierckpt's newest committed step, False)."""
    try:
        text = Path(tracker).read_text(encoding="utf-8").strip()
    except OSError:
        text = ""
    from megatron.training.global_vars import get_args

    if text == "release" or get_args().ckpt_format != "torch_dist":
        return original(tracker)  # a release, or torch_dcp/fsdp_dtensor folders: Megatron's
    group = checkpoint_groups(None)[0]
    probe = TieredStorageReader(namespace, None, process_group=group)
    try:
        probe.read_metadata()
    except StepNotFoundError:
        # Nothing committed in tierckpt: the tracker's step (max over the ranks, as Megatron's).
        ours = torch.tensor([int(text) if text.isdigit() else -1], dtype=torch.long)
        if group is not None:
            dist.all_reduce(ours, op=dist.ReduceOp.MAX, group=group)
        logger.warning("%s: no committed step in tierckpt; the tracker says %s", namespace, text)
        return int(ours.item()), False
    step = probe.resolved_step
    assert step is not None
    if text != str(step):
        logger.warning(
            "%s names iteration %r; the newest step committed in tierckpt://%s is %d: loading %d",
            tracker,
            text,
            namespace,
            step,
            step,
        )
    return step, False


class Installed:
    """The patches :func:`install` made; :meth:`uninstall` (or leaving the ``with`` block) puts
    Megatron-LM's own functions back."""

    def __init__(self, namespace: str, *, persist: bool | None, timeout_s: float):
        import megatron.training.async_utils as async_utils
        import megatron.training.checkpointing as checkpointing
        import megatron.training.training as training

        self.namespace = namespace
        self.saves = _Saves(timeout_s)
        original_read = checkpointing.read_metadata
        original_format = checkpointing._get_checkpoint_format
        original_schedule = async_utils.schedule_async_save
        original_finalize = async_utils.maybe_finalize_async_save
        original_empty = async_utils.is_empty_async_queue

        def read_metadata(tracker_filename: str) -> tuple[int, bool]:
            return _newest_step(namespace, tracker_filename, original_read)

        def get_checkpoint_format(checkpoint_name: str, args: Any) -> Any:
            if step_of(checkpoint_name) is not None:
                return "torch_dist"
            return original_format(checkpoint_name, args)

        def schedule_async_save(async_request: Any) -> None:
            if isinstance(async_request, _Request):
                self.saves.schedule(async_request)
            else:
                original_schedule(async_request)  # not ours: Megatron's own queue

        def maybe_finalize_async_save(blocking: bool = False, terminate: bool = False) -> None:
            self.saves.finalize(blocking)
            original_finalize(blocking, terminate)

        def is_empty_async_queue() -> bool:
            return self.saves.empty() and bool(original_empty())

        dist_ckpt = _DistCheckpointing(checkpointing.dist_checkpointing, namespace, persist)
        self._patches: list[tuple[Any, str, Any]] = [
            (checkpointing, "dist_checkpointing", dist_ckpt),
            (checkpointing, "read_metadata", read_metadata),
            (checkpointing, "_get_checkpoint_format", get_checkpoint_format),
            (checkpointing, "schedule_async_save", schedule_async_save),
            (checkpointing, "is_empty_async_queue", is_empty_async_queue),
            (async_utils, "schedule_async_save", schedule_async_save),
            (async_utils, "is_empty_async_queue", is_empty_async_queue),
            (async_utils, "maybe_finalize_async_save", maybe_finalize_async_save),
            (training, "maybe_finalize_async_save", maybe_finalize_async_save),
        ]
        self._originals = [(m, name, getattr(m, name)) for m, name, _ in self._patches]
        for module, name, value in self._patches:
            setattr(module, name, value)

    def uninstall(self) -> None:
        """Put Megatron-LM's functions back (async saves in flight still finish)."""
        for module, name, value in self._originals:
            setattr(module, name, value)
        self._originals = []

    def __enter__(self) -> Installed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


_installed: Installed | None = None


def install(namespace: str, *, persist: bool | None = None, timeout_s: float = 3600.0) -> Installed:
    """Make Megatron-LM's ``save_checkpoint``/``load_checkpoint`` store ``torch_dist``
    checkpoints as steps of ``namespace`` (``iter_N`` -> ``tierckpt://namespace/N``); call on
    every rank before training. Returns the handle that undoes it (also a context manager).

    Args:
        persist: as :func:`tierckpt_client.integrations.megatron.save`.
        timeout_s: the most a blocking ``maybe_finalize_async_save`` (the end of training) waits
            for the saves in flight before ``TimeoutError``.
    """
    global _installed
    parse_checkpoint_id(format_checkpoint_id(namespace, 0))  # a bad namespace fails here
    if "megatron.training.checkpointing" not in sys.modules:
        try:
            import megatron.training.checkpointing  # noqa: F401
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"install() hooks Megatron-LM's megatron.training, which cannot be imported ({e});"
                " the megatron-core 0.19.2 wheel has it, 0.16.1 not (Python >= 3.12). For"
                " megatron-core alone use tierckpt_client.integrations.megatron.save/load"
            ) from e
    if _installed is not None and _installed._originals:
        raise RuntimeError(
            f"tierckpt is already installed into Megatron-LM (namespace {_installed.namespace!r});"
            " uninstall() it first"
        )
    _installed = Installed(namespace, persist=persist, timeout_s=timeout_s)
    return _installed
