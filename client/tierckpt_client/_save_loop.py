"""What every save loop here shares (:class:`~tierckpt_client.Checkpointer` and the framework
integrations): the one asynchronous save in flight and its error, raised once and never dropped;
the options such a loop takes; the async modes by name."""

from __future__ import annotations

import io
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from tierckpt_client import _gc_pause, _save_plan
from tierckpt_client._shards import plain_shard
from tierckpt_client.dcp import _async_staging
from tierckpt_core.errors import TierCkptError

# Public (re-exported by checkpointer, as checkpoint_groups is): async_mode -> DCP's type.
ASYNC_MODES = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


class SaveFailedError(TierCkptError):
    """A background save failed; raised by the next ``save`` or ``wait``. ``__cause__`` is the
    original error."""

    code = "save_failed"

    @classmethod
    def of(cls, what: str, error: BaseException) -> SaveFailedError:
        """The error for a save (``what``: "ns: the save of step N") that failed with ``error``."""
        return cls(
            f"{what} failed: {error}; that step is not checkpointed (steps committed before it "
            "are not affected)"
        )


def check_save_options(persist_every: int | None, async_mode: str) -> None:
    """ValueError naming the argument, for the options every save loop here takes (the
    :class:`Checkpointer`, the framework integrations)."""
    if persist_every is not None and persist_every < 1:
        raise ValueError(f"persist_every must be >= 1 or None, got {persist_every}")
    if async_mode not in ASYNC_MODES:
        raise ValueError(f"async_mode must be 'thread' or 'process', got {async_mode!r}")


class SaveInFlight:
    """The one asynchronous save a loop has in flight (the :class:`Checkpointer`, the framework
    integrations): its step, and its error raised once, as :class:`SaveFailedError`, by
    :meth:`wait` rather than dropped.

    A save staged asynchronously (``async_save`` returned an ``AsyncSaveResponse``) is waited
    for by the loop's next optimizer step, whichever optimizer (a global pre-step hook,
    ``dcp._async_staging``), and by :meth:`wait_staged`."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.step: int | None = None
        self._future: Future[Any] | None = None
        self._staging: Future[Any] | None = None

    def start(self, step: int, result: Any) -> None:
        """Track what ``dcp.async_save`` returned for ``step`` (a future or a response)."""
        if isinstance(result, AsyncSaveResponse):
            self._future, self._staging = result.upload_completion, result.staging_completion
            _async_staging.wait_before_optimizer_steps(result.staging_completion)
        else:
            self._future, self._staging = result, None
        self.step = step

    def wait_staged(self) -> None:
        """Return once the save in flight no longer reads the state: from then on the loop may
        change it. A failed stage is raised by :meth:`wait`."""
        fut, self._staging = self._staging, None
        _async_staging.wait_staged(fut, f"{self.namespace}/step {self.step}")

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise :class:`SaveFailedError` if it failed."""
        self.wait_staged()
        step, fut = self.step, self._future
        if fut is None:
            return
        self.step = self._future = None
        try:
            fut.result()
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise SaveFailedError.of(f"{self.namespace}: the save of step {step}", e) from e


def staging_done(fut: Future[Any]) -> Future[None]:
    """A future done when ``fut`` (a stage's) is, with its error or None: what
    ``AsyncSaveResponse.staging_completion`` holds."""
    out: Future[None] = Future()

    def chain(f: Future[Any]) -> None:
        e = f.exception()
        if e is None:
            out.set_result(None)
        else:
            out.set_exception(e)

    fut.add_done_callback(chain)
    return out


class _Planner(DefaultSavePlanner):
    """DCP's default save planner, its planning with the cyclic collector paused
    (:mod:`tierckpt_client._gc_pause`): several objects per tensor, in a process of hundreds
    of thousands. Only the planning: the rest of a save (a commit waiting for replicas, a
    degraded save's upload) may take minutes, and the collector is not held off that long."""

    pause_gc = True

    def set_up_planner(
        self,
        state_dict: STATE_DICT_TYPE,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:  # (DCP reads this signature: storage_meta by name)
        with _gc_pause.paused(self.pause_gc):
            super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        with _gc_pause.paused(self.pause_gc):
            # DTensors' items made without DCP's per-DTensor work (tierckpt_client._save_plan);
            # DCP plans (and caches) as always over the stand-ins, only for this call.
            known = _save_plan.with_known_items(self.state_dict)
            if known is None:
                return super().create_local_plan()
            state, self.state_dict = self.state_dict, known
            try:
                return super().create_local_plan()
            finally:
                self.state_dict = state

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        # A DTensor's shard: what DCP's lookup returns (to_local(), an autograd call outside
        # no_grad, ~60 us) is the local tensor, which the writer takes detached.
        if write_item.type == WriteItemType.SHARD:
            shard = plain_shard(self.state_dict.get(write_item.index.fqn))
            if shard is not None:
                return shard
        return super().resolve_data(write_item)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        with _gc_pause.paused(self.pause_gc):
            return super().create_global_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        with _gc_pause.paused(self.pause_gc):
            return super().finish_plan(new_plan)


def caching_planner(key: str, pause_gc: bool = True) -> DefaultSavePlanner:
    """DCP's default save planner with its plan caching on, under ``key`` (one per save loop):
    a save whose local plan is the last one's sends the coordinator an empty plan, and the
    coordinator reuses its global plan and metadata (with 2048 tensors the global planning was
    ~100 ms of every save's background work on the 2-core box). DCP keys its caches by the
    planner's class name, shared by every planner of the process: two loops of other layouts,
    or of other groups, must not meet there, hence a key of their own. Where torch has no such
    key, caching stays off. :func:`forget_plans` drops the key's entries. The planning runs
    with the collector paused unless ``pause_gc`` is False (:class:`_Planner`)."""
    planner = _Planner()
    planner.pause_gc = pause_gc
    if hasattr(planner, "_cached_plans_key") and hasattr(planner, "_enable_plan_caching"):
        planner._enable_plan_caching = True
        planner._cached_plans_key = key
    return planner


def forget_plans(key: str) -> None:
    """Drop what DCP cached under ``key`` (a loop closed)."""
    for name, cache in vars(SavePlanner).items():
        if name.startswith("_cached_") and isinstance(cache, dict):
            cache.pop(key, None)
