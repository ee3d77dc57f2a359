"""``TieredStorageWriter``: DCP storage writer (and async stager) backed by the node-local daemon."""

from __future__ import annotations

import logging
import os
import socket
import uuid
import weakref
from collections.abc import Iterable
from concurrent.futures import Future as StagingFuture
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt_client import _gc_pause
from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena, _assign, _async_staging, _dcp_log, _items, _prelease
from tierckpt_client.dcp._attempt import SaveFiles
from tierckpt_client.dcp._items import SaveStats
from tierckpt_client.dcp._plan_data import (
    LocalPlanData,
    PlanData,
    RankLayout,
    attempt_base,
    check_options,
    commit_request,
    next_attempt,
    refuse_rank_local,
)
from tierckpt_client.dcp._staging import stage_into, staging_size
from tierckpt_client.dcp.ids import format_checkpoint_id, is_checkpoint_id, parse_checkpoint_id
from tierckpt_client.dcp.targets.choice import Targets
from tierckpt_core.errors import (
    DaemonUnavailableError,
    InvalidNameError,
    NotReplicatedError,
    StagingRaceError,
    StepStateError,
)
from tierckpt_core.protocol import validate_namespace, validate_step

logger = logging.getLogger(__name__)


class TieredStorageWriter(StorageWriter, AsyncStager):
    """Save DCP checkpoints into the node's shared-memory tier.

    Args:
        namespace: the job's namespace (letters, digits, ``.``, ``_``, ``-``); may come from
            ``checkpoint_id="tierckpt://<namespace>/<step>"`` instead.
        step: the training step this checkpoint belongs to.
        persist: ask the daemon to persist this step (``None``: the daemon's policy decides).
        config: how to reach the daemon (default :meth:`ClientConfig.from_env`).
        on_unavailable: when the daemon cannot be reached or has no room: ``"persist"`` (default)
            writes the step straight to the persistent tier (``config.persist_url``) and logs one
            WARNING; ``"raise"`` fails the save. Training never hangs on the daemon: every call
            has a timeout.
        overwrite: ``True`` (default, as torch's ``FileSystemWriter``): saving a step that is
            already committed replaces it. ``False``: such a save fails with ``StepStateError``
            before any rank writes, and the committed step stays (the daemon checks again in the
            commit itself, so two racing saves cannot both replace it).
        async_staging: with ``async_save``, ``stage`` returns a future and the copy into the
            tier runs while the loop goes on; ``async_save`` then returns an
            ``AsyncSaveResponse`` at once, and the loop must wait for its
            ``staging_completion`` before it changes the state (before ``optimizer.step()``;
            see ``_async_staging``). Off by default here, since it changes what
            ``async_save`` returns (a response, not a future); :class:`Checkpointer` turns it
            on (``TIERCKPT_ASYNC_STAGING``) and does the waiting.
        copied_at_stage: with ``async_staging``, tensors (of the state) that ``stage`` copies
            itself before it returns, so that the loop may change them right after: buffers a
            forward updates (BatchNorm's running statistics). Small ones only: their copy is on
            the training thread. :class:`Checkpointer` passes its modules' buffers.
        wait: when the save counts as done (its future completes, ``dcp.save`` returns):
            ``"committed"`` (default) once the step is committed in the memory of the nodes its
            ranks wrote to, which survives a trainer's death, not the loss of such a node until
            its share is replicated; ``"replicated"`` once every share of the step also has its
            replicas on ``TIERCKPT_REPLICAS`` peers (so losing any one node keeps it), or fails
            with ``StepStateError`` (the step stays committed) when that cannot happen within
            ``replicated_timeout_s``. A save that went straight to the persistent tier is
            durable when it returns. See docs/operations.md, "What an acknowledged save
            survives".
        replicated_timeout_s: the longest wait for the replicas with ``wait="replicated"``.

    Call order, as DCP drives it (``async_save`` adds ``stage`` in the trainer first)::

        stage(state_dict)            trainer, blocking: lease a file, copy every tensor into it
        reset(checkpoint_id)         all ranks (only when a checkpoint_id is passed)
        set_up_storage_writer()      all ranks
        prepare_local_plan()         all ranks: say which daemon holds this rank's files, or that
                                     it cannot reach one
        prepare_global_plan()        coordinator: a fresh save attempt id for all ranks, and
                                     "direct" mode if a rank has no daemon or the ranks span
                                     several daemons (nodes)
        write_data()                 all ranks: record where each item lives; bytes items and any
                                     tensor that was not staged go into a second file; the files
                                     are sealed into the step (or, direct: uploaded)
        finish()                     coordinator: commit the step with its metadata on the daemon
                                     (or, direct: write the manifest and commit marker)

    With ``async_save`` the writer is its own stager: ``stage`` copies each tensor (device to host,
    or host to host) straight into the leased file and returns tensors that alias it, so the
    trainer blocks for exactly one copy and ``write_data`` copies nothing. In PROCESS mode the
    writer and the staged state dict are pickled into DCP's helper process; the staged tensors travel
    as references to the file (see ``_arena``), and the daemon connection is re-created there.

    With ``async_staging`` the same copy runs on a helper thread (a side CUDA stream for device
    tensors) and ``stage`` returns at once; a tensor the loop changes in place before the copy is
    done fails the save with ``StagingRaceError`` in ``prepare_local_plan`` (on every rank, as
    DCP fails a plan), never a torn step.

    One writer serves one save at a time; use a new writer (or wait for the previous save) per save.
    """

    # async_save never calls synchronize_staging: a synchronous stage has nothing to wait for,
    # and an asynchronous one is waited for through its future (staging_completion).
    _synchronize_after_execute = False

    def __init__(
        self,
        namespace: str | None = None,
        step: int | None = None,
        *,
        persist: bool | None = None,
        config: ClientConfig | None = None,
        on_unavailable: str = "persist",
        overwrite: bool = True,
        async_staging: bool = False,
        wait: str = "committed",
        replicated_timeout_s: float = 300.0,
        copied_at_stage: Iterable[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        self.async_staging = async_staging
        self._copied_at_stage = _async_staging.storages(copied_at_stage)
        self._staging: StagingFuture[dict[str, Any]] | None = None
        self._torn: StagingRaceError | None = None  # the loop changed a tensor while staged
        check_options(on_unavailable, wait, replicated_timeout_s)
        self.wait = wait
        self.replicated_timeout_s = replicated_timeout_s
        self.on_unavailable = on_unavailable
        self.namespace = validate_namespace(namespace) if namespace is not None else None
        self.step = validate_step(step) if step is not None else None
        self.persist = persist
        self.overwrite = overwrite
        self.config = config or ClientConfig.from_env()
        self._daemon = DaemonClient.shared(self.config)
        _dcp_log.drop_discarded_debug_records()  # DCP's, dropped unseen: ~20 per save
        # What this save holds on the daemon, from stage()'s lease to finish()'s commit; given
        # back by a failed write_data or finish, by close(), or when the writer is collected.
        self._files = SaveFiles(self._daemon)
        self._track_files()
        # Where this save's files go (see targets.choice): the memory tier, or the persistent one.
        self._targets = Targets(
            self._daemon,
            self.config,
            on_unavailable=on_unavailable,
            overwrite=overwrite,
            discard=self._files.drop,
        )
        self._plan_data: PlanData | None = None
        self._attempt: str | None = None
        self._rank_nodes: list[str | None] | None = None  # coordinator: the node of each rank
        self.rank = 0
        self.is_coordinator = True
        self.last_stats: SaveStats | None = None
        self._next = _prelease.NextFile(self.config.prelease)  # the next save's file
        self._assignment = _assign.SaveAssignment()  # what stage() left out (another rank's)
        self.last_stage_bytes = 0  # bytes stage() copied
        _arena.install_pickle_reducer()

    # -- identity ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is None:
            return
        namespace, step = parse_checkpoint_id(checkpoint_id)
        if step is None:
            raise InvalidNameError(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} names no step; a save needs "
                "tierckpt://<namespace>/<step>"
            )
        self.namespace, self.step = namespace, step

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return format_checkpoint_id(self.namespace or "?", self.step)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=uuid.uuid4().hex)

    def _require_target(self) -> tuple[str, int]:
        if self.namespace is None or self.step is None:
            raise InvalidNameError(
                "TieredStorageWriter needs a namespace and a step: pass them to the constructor or "
                "checkpoint_id='tierckpt://<namespace>/<step>'"
            )
        return self.namespace, self.step

    def _require_namespace(self) -> str:
        if self.namespace is None:
            raise InvalidNameError(
                "TieredStorageWriter needs a namespace before staging: with async_save, pass it to "
                "the constructor (a checkpoint_id is only applied after staging)"
            )
        return self.namespace

    def _track_files(self) -> None:
        finalizer = weakref.finalize(self, self._files.give_back_soon)
        finalizer.atexit = False  # at exit the daemon reclaims them (lease_ttl_s)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # PROCESS-mode async_save pickles the writer right after stage() to hand the save to its
        # helper process (a fresh connection there): the staged file belongs to that copy from
        # now on, so this one can stage the next save.
        state["_daemon"] = daemon = DaemonClient.shared(self.config)
        state["_files"] = files = self._files.hand_over(daemon)
        state["_targets"] = self._targets.hand_over(daemon, files.drop)
        state["_staging"] = None  # done by now: DCP pickles the writer after staging_completion
        state["_next"] = self._next.hand_over()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._track_files()

    # -- AsyncStager ------------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | StagingFuture[dict[str, Any]]:
        namespace = self._require_namespace()
        if self._files.staged is not None or (self._staging and not self._staging.done()):
            raise StepStateError(
                f"{namespace}: stage() called again before the previous save was written; use one "
                "TieredStorageWriter per save, or wait for the previous save's future"
            )
        if not self.async_staging:
            return self._stage_now(namespace, state_dict, None)
        # Here, before the loop changes anything: the versions, and the non-tensor values.
        marks, skeleton = _async_staging.Marks.take(state_dict, self._copied_at_stage)
        self._staging = _async_staging.submit(lambda: self._stage_now(namespace, skeleton, marks))
        return self._staging

    def _stage_now(
        self, namespace: str, state_dict: dict[str, Any], marks: _async_staging.Marks | None
    ) -> dict[str, Any]:
        """Lease a file and copy every tensor into it (the trainer's thread, or with ``marks``
        the asynchronous stager's: then on side streams, and the tensors' versions checked),
        the cyclic collector paused (:mod:`tierckpt_client._gc_pause`)."""
        with _gc_pause.paused(self.config.pause_gc):
            return self._stage_paused(namespace, state_dict, marks)

    def _stage_paused(
        self, namespace: str, state_dict: dict[str, Any], marks: _async_staging.Marks | None
    ) -> dict[str, Any]:
        self._torn = None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        skip = self._assignment.plan(state_dict, str(self.config.socket), namespace, rank, world)
        size = staging_size(state_dict, skip)
        self.last_stage_bytes = size
        if size == 0:  # nothing this rank writes (or no tensors): no file
            self._next.staged()
            return stage_into(state_dict, None, skip=skip).state_dict
        claim = not self._targets.degraded  # the file the previous save pre-leased, if any
        staged = self._next.claim(self.config.socket, namespace, rank, size) if claim else None
        staged = staged or self._targets.new_file(namespace, rank, size)
        try:
            with marks.streams() if marks is not None else nullcontext():
                result = stage_into(
                    state_dict, staged.mapping(), pin_memory=self.config.pin_memory, skip=skip
                )
        except BaseException:
            self._files.drop(namespace, staged)
            raise
        self._files.hold_staged(namespace, staged)
        self._next.staged()
        if marks is not None:
            try:
                marks.check(f"{namespace}/step {self.step} (rank {rank})")
            except StagingRaceError as e:
                # Not raised here: this rank would leave DCP's save on the others waiting in
                # its first collective; prepare_local_plan fails the save on every rank.
                self._torn = e
        return result.state_dict

    def synchronize_staging(self) -> None:
        """Wait for an asynchronous stage (torch's older protocol; ``async_save`` waits through
        the future ``stage`` returned)."""
        if self._staging is not None:
            self._staging.exception()

    def close(self) -> None:
        """Give back what a failed save left: a staged file that was never written, a save
        attempt that was never committed (done anyway when the writer is garbage-collected)."""
        self._files.give_back()
        self._daemon.close()

    # -- StorageWriter ----------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        namespace, step = self._require_target()
        if kwargs.get("use_collectives") is False:
            refuse_rank_local(namespace, step)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self._torn is not None:
            self._files.drop_staged()
            raise self._torn
        self._assignment.check_names(plan, f"{self.checkpoint_id}: rank {self.rank}")
        direct = self._targets.degraded
        if not direct and not self._daemon.ping():
            self._targets.degrade(
                DaemonUnavailableError(f"cannot reach the tierckpt daemon at {self.config.socket}")
            )
            direct = True
        if not direct and not self.overwrite:
            self._refuse_early()
        if not direct and self._files.staged is None and self._next.staged_by is None:
            direct = self._reserve(plan)  # a plain save: nothing was staged
        daemon = f"{socket.gethostname()}:{self.config.socket}"
        node = None if direct else self._daemon.node()
        return replace(plan, storage_data=LocalPlanData(direct=direct, daemon=daemon, node=node))

    def _refuse_early(self) -> None:
        """``overwrite=False`` and the step exists: refuse on every rank before the plans meet,
        giving back what stage() leased. Seen by the coordinator alone (prepare_global_plan), the
        other ranks would get no writer call after DCP's exception: their staged files would stay
        leased until the writer is collected or the daemon's ``lease_ttl_s`` (900 s) expires."""
        namespace, step = self._require_target()
        try:
            self._targets.memory.begin(namespace, step)
        except BaseException:
            self._files.give_back()
            raise

    def _reserve(self, plan: SavePlan) -> bool:
        """A plain ``save`` (nothing was staged) leases its file now, while the ranks still agree
        where the save goes: a file that does not fit in the memory tier then sends the whole save
        to the persistent tier (``on_unavailable="persist"``) rather than failing in write_data,
        as a staged save does. True if this rank cannot use the memory tier."""
        namespace = self._require_namespace()
        size = _items.planned_size(plan)
        if not size:
            return False
        reserved = self._targets.reserve(namespace, self.rank, size)
        if reserved is None:
            return True
        self._files.hold_reserved(namespace, reserved)
        return False

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        namespace, step = self._require_target()
        layout = RankLayout.of(namespace, step, plans)
        self._rank_nodes = layout.rank_nodes
        if layout.unpeered and self._targets.persistent is None:
            self._targets.degrade(StepStateError(layout.why_unpeered(namespace, step)))
        data = PlanData(
            attempt_base=attempt_base(), direct=layout.direct, across=layout.rank_nodes is not None
        )
        try:
            self._targets.chosen(namespace, step, data.direct).begin(namespace, step)
        except BaseException:
            self._files.give_back()  # the coordinator's own lease, now (others: _refuse_early)
            raise
        return [replace(p, storage_data=data) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        namespace, step = self._require_target()
        data = plan.storage_data
        if not isinstance(data, PlanData):
            raise StepStateError(f"{namespace}/step {step}: the save plan carries no attempt id")
        attempt = next_attempt(data.attempt_base, namespace, step)  # first: the same on all ranks
        target = self._targets.chosen(namespace, step, data.direct)
        files = self._files
        data_name = f"r{self.rank:05d}.data"
        try:
            if target is not self._targets.memory:
                files.drop_reserved()  # another rank sent the save elsewhere
            staged = files.staged
            if staged is not None and staged.lease_id is None:
                data.check_cached(f"{namespace}/step {step}: rank {self.rank}")
            mapping = staged.mapping() if staged is not None else None
            results, pending = _items.place(plan, planner, mapping, data_name)
            self._assignment.check_snapshot(pending, f"{namespace}/step {step}: rank {self.rank}")
            kept = None
            if mapping is not None and results:
                kept = files.keep_staged(data_name)
            else:  # nothing staged, or the planner replaced every tensor: nothing to keep of it
                files.drop_staged()
            extra, extra_results, copied = _items.pack_extra(
                target,
                namespace,
                self.rank,
                pending,
                files.drop,
                files.take_reserved(),
                pin_memory=self.config.pin_memory,
            )
            if extra is not None:
                files.keep(namespace, extra)
            if kept is not None and mapping is not None:
                # Only the items this rank writes stay in the file (stage() may have copied
                # more: the first save of a layout); the daemon cuts off the rest at the seal.
                kept.length = _items.compact(results, mapping, data_name)
                if data.across:
                    kept.segments = _items.segments(results, mapping, data_name)
            results.extend(extra_results)
            # Sealed; on the coordinator, if the save fails before finish() commits it, the
            # attempt is aborted.
            note = self.is_coordinator and target is self._targets.memory
            sealed = files.seal(target, namespace, step, attempt, self.rank, note=note)
            self._plan_data, self._attempt = data, attempt
        except BaseException:
            files.release_unsealed()
            raise
        if target is self._targets.memory and sealed and sealed[0].name == data_name:
            # PROCESS mode: the next stage runs in the trainer, not here: sent there.
            self._next.ask(self._daemon, namespace, self.rank, (step, attempt), sealed[0].length)
        self._assignment.tell(plan)
        self.last_stats = SaveStats.of(results, pending, data_name, copied)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        namespace, step = self._require_target()
        data, attempt = self._plan_data, self._attempt
        if data is None or attempt is None:
            raise StepStateError(f"{namespace}/step {step}: finish() without write_data()")
        req = commit_request(metadata, results, self._rank_nodes, self.persist, self.overwrite)
        target = self._targets.chosen(namespace, step, data.direct)
        try:
            target.commit(namespace, step, attempt, req)
        except BaseException:
            self._files.give_back()  # the attempt's memory is free now, not after lease_ttl_s
            raise
        self._files.committed()
        if self.wait == "replicated" and target is self._targets.memory:
            try:
                self._daemon.wait_replicated(namespace, step, self.replicated_timeout_s)
            except NotReplicatedError:
                raise
            except StepStateError as e:  # a daemon older than NotReplicatedError
                raise NotReplicatedError(str(e)) from None
