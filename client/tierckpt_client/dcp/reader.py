"""``TieredStorageReader``: DCP storage reader that loads from the node-local daemon's memory tier."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt_client import _gc_pause
from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena, _dcp_log
from tierckpt_client.dcp._corruption import report
from tierckpt_client.dcp._fallback import (
    FAILED,
    OK,
    Agreement,
    agree,
    agreement,
    misfit_error,
    outcome,
    plan_misfit,
)
from tierckpt_client.dcp._metadata_codec import (
    DTYPES,
    ShardRef,
    copy_tensor,
    decoded,
    takes_whole,
)
from tierckpt_client.dcp.ids import format_checkpoint_id, is_checkpoint_id, parse_checkpoint_id
from tierckpt_client.dcp.read_plan import Planner, ReadPlan
from tierckpt_client.dcp.sources import RANGED_READ_MAX, Source, StepFiles
from tierckpt_core.errors import (
    CheckpointFormatError,
    IntegrityError,
    NotFoundError,
    PeerUnavailableError,
    StepStateError,
    TierCkptError,
)
from tierckpt_core.protocol import validate_namespace, validate_step

logger = logging.getLogger(__name__)

__all__ = ["RANGED_READ_MAX", "TieredStorageReader"]


def _destination(planner: LoadPlanner, item: ReadItem) -> torch.Tensor:
    """Where ``item`` lands: the planner's tensor, detached where it needs it (DCP's readers
    detach every one; a state dict's tensors seldom require grad, and ``detach`` makes a new
    tensor object: ~1 us a tensor, thousands a load)."""
    target = planner.resolve_tensor(item)
    return target.detach() if target.requires_grad else target


class TieredStorageReader(StorageReader):
    """Load DCP checkpoints through the node's daemon: from memory, or from the persistent tier.

    Args:
        namespace: the job's namespace; may come from ``checkpoint_id="tierckpt://<namespace>[/<step>]"``.
        step: the step to load; ``None`` loads the newest step that is committed in memory or
            durable in the persistent tier and verifies (older ones are tried, with a warning, when
            a newer one is corrupt or incomplete, or is found corrupt while it is read: then
            every rank reads the older one; :attr:`resolved_step` says which was loaded). Rank 0
            of ``process_group`` decides and broadcasts it, so all ranks load the same step; a
            ``dcp.load(..., no_dist=True)``, or one without a process group, decides it alone.
        config: how to reach the daemon (default :meth:`ClientConfig.from_env`).
        process_group: the group to agree on the step with when ``step`` is ``None`` (default:
            the group ``dcp.load`` runs on).

    Call order, as DCP drives it::

        reset(checkpoint_id)        all ranks (only when a checkpoint_id is passed)
        read_metadata()             all ranks: resolve the step (agreed across ranks); have the
                                    daemon hydrate it from the persistent tier if it is not in
                                    memory; fetch its metadata
        set_up_storage_reader()     all ranks
        prepare_local_plan()        all ranks: tag the plan with the step this rank resolved
        prepare_global_plan()       coordinator: check every rank resolved the same step
        read_data()                 all ranks: pin the step, map its files, copy each requested
                                    region into the destination tensor, unpin; for "latest",
                                    agree that no rank found the step corrupt, else read the
                                    next older step on every rank (see ``_fallback``)

    Tensors are stored raw (dtype, shape and offset in the metadata), so reading a tensor is a view
    of the mapped file and one copy into the destination; resharding narrows the stored chunk to
    the requested region first. Only bytes items (non-tensor state) go through ``torch.load``.

    Without a reachable daemon, and with ``config.persist_url`` set (``TIERCKPT_PERSIST_URL``), the
    reader reads the persistent tier itself: same format, every file verified. With it set, a
    durable step that no node holds in memory is read straight from the persistent tier into the
    destination tensors, every block verified, and the daemon brings it into memory afterwards
    (:attr:`memory_fill`) for the next restore (``config.restore_direct``, default: for ``s3://``).
    """

    def __init__(
        self,
        namespace: str | None = None,
        step: int | None = None,
        *,
        config: ClientConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.namespace = validate_namespace(namespace) if namespace is not None else None
        self.step = validate_step(step) if step is not None else None
        self.config = config or ClientConfig.from_env()
        self.process_group = process_group
        self._daemon = DaemonClient.shared(self.config)
        _dcp_log.drop_discarded_debug_records()  # DCP's, dropped unseen: ~20 per save
        # Which step this load reads, and from where (see read_plan): chosen once, in
        # read_metadata (and again below a step found corrupt while it is read).
        self._planner = Planner(self._daemon, self.config)
        self._plan: ReadPlan | None = None
        self._resolved: int | None = None
        # Whom a load of "latest" agrees with on falling back past a step found corrupt while
        # it is read (set when the step is resolved; None for an explicit step).
        self._agreement: Agreement | None = None
        self._storage: dict[Any, ShardRef] = {}
        self.load_id = uuid.uuid4().hex
        # What this rank's last read_data read: bytes of stored items, and of those the bytes in
        # files its node's daemon had to fetch from other nodes first.
        self.read_bytes = 0
        self.fetched_bytes = 0
        self._fetched: set[str] = set()
        # The metadata resolve() fetched, for the load's read_metadata to answer with.
        self._ahead: Metadata | None = None
        # Set when the last read_data agreed with its group that every rank read the step (a
        # load that agrees after the read itself, ``_local_load``, need not ask again).
        self.read_agreed: Agreement | None = None

    @property
    def memory_fill(self) -> threading.Thread | None:
        """After a load read straight from the persistent tier or the peers: the thread in which
        the daemon brings the step into this node's memory for the next restore (the load does
        not wait for it; ``join()`` it to). None after a load from this node's memory."""
        return self._plan.source.filling if self._plan is not None else None

    # -- identity ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._ahead = None
        self._resolved = None
        self._agreement = None
        self._plan = None
        self.load_id = uuid.uuid4().hex
        if checkpoint_id is not None:
            self.namespace, self.step = parse_checkpoint_id(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_checkpoint_id(checkpoint_id)

    @property
    def checkpoint_id(self) -> str:
        return format_checkpoint_id(self.namespace or "?", self._resolved or self.step)

    @property
    def resolved_step(self) -> int | None:
        """The step this reader loaded (or is loading), once ``read_metadata`` ran."""
        return self._resolved

    def _require_namespace(self) -> str:
        if self.namespace is None:
            raise TierCkptError(
                "TieredStorageReader needs a namespace: pass it to the constructor or "
                "checkpoint_id='tierckpt://<namespace>[/<step>]'"
            )
        return self.namespace

    def resolve(self) -> int:
        """Choose the step the next load reads (``latest``: the newest good one, the same on
        every rank: call it on every rank) and fetch its metadata, which that load's
        ``read_metadata`` then uses instead of asking again (a Checkpointer restore tells a
        fresh start from a resume this way). NamespaceNotFoundError or StepNotFoundError."""
        self._ahead = self.read_metadata()
        assert self._resolved is not None
        return self._resolved

    # -- StorageReader ----------------------------------------------------------------------
    # No **kwargs on purpose: DCP then does not retry with rank-local metadata (which tierckpt
    # does not have). DCP 2.13 still wraps this method's error in an AssertionError carrying its
    # message ("metadata is None; global metadata read failed: ..."); a Checkpointer's load
    # (``_local_load``) keeps the error as it is.
    def read_metadata(self) -> Metadata:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # resolve() just chose the step and planned its source
            return ahead
        namespace = self._require_namespace()
        # Each load starts from this node's daemon (DCP calls reset() only when given a
        # checkpoint_id): a reader reused after a load from elsewhere must not stay there.
        self._planner.reset()
        self._plan = None
        if self.step is not None:
            self._agreement = None  # an explicit step: no fallback, nothing to agree on
            return self._step_metadata(self.step)
        self._agreement = agreement(self.process_group)
        return self._step_metadata(self._planner.latest(namespace, self._agreement))

    def _step_metadata(self, chosen: ReadPlan | int) -> Metadata:
        """Make the step chosen the one this reader loads, plan where it reads it from, and
        return its metadata."""
        namespace = self._require_namespace()
        self._resolved = chosen.step if isinstance(chosen, ReadPlan) else chosen
        self._plan, doc = self._planner.plan(namespace, chosen)
        metadata = decoded(doc, where=f"{namespace}/step {self._resolved}")
        metadata.storage_meta = replace(
            metadata.storage_meta or StorageMeta(), load_id=self.load_id
        )
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._storage = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # Whether the rank falls back past a corrupt step goes with the step: ranks that differ
        # would not meet in read_data's agreement.
        return replace(plan, storage_data=(self._resolved, self._agreement is not None))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = {p.storage_data for p in plans}
        kind = {True: "latest", False: "explicit"}
        if len(steps) > 1:
            raise StepStateError(
                f"{self.namespace}: ranks resolved different steps "
                f"{sorted(f'{s} ({kind[latest]})' for s, latest in steps)}; "
                "pass process_group= to TieredStorageReader (the group dcp.load runs on) or an "
                "explicit step"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.read_agreed = None
        with _gc_pause.paused(self.config.pause_gc):
            if self._agreement is None:  # an explicit step: it is read, or the load fails
                self._read_plan(plan, planner)
            else:
                self._read_latest(plan, planner, self._agreement)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_latest(self, plan: LoadPlan, planner: LoadPlanner, how: Agreement) -> None:
        """Read the plan from the step "latest" resolved to; if any rank finds it corrupt, every
        rank reads the next older step that verifies instead, into the same destinations (see
        ``_fallback``). A step of another layout than the plan's fails the load, naming it."""
        namespace = self._require_namespace()
        corrupt: list[str] = []
        older: ReadPlan | int | None = None
        while True:
            error: BaseException | None = None
            try:
                if older is not None:
                    self._switch(plan, older)
                self._read_plan(plan, planner)
            except BaseException as e:  # every rank must reach the agreement, whatever it met
                error = e
            status, found = agree(outcome(error), how)
            if status == OK:  # (on every rank of the group: none fails this read)
                self.read_agreed = how
                return
            if status == FAILED:  # not corruption: the load fails (the ranks that failed say why)
                if error is not None:
                    raise error
                return
            bad = self._resolved
            assert bad is not None
            corrupt.append(f"step {bad}: {'; '.join(found)}")
            self._plan = None
            try:
                # The plan below the corrupt step: the daemon's way, unless it is gone.
                older = self._planner.latest(namespace, how, bad)
            except NotFoundError as e:
                raise IntegrityError(
                    f"{namespace}: {'; '.join(corrupt)}; and no older step could be restored ({e})"
                ) from None
            logger.warning(
                "%s/step %d is corrupt (%s); loading the next older step, %d, on every rank "
                "instead",
                namespace,
                bad,
                "; ".join(found),
                older if isinstance(older, int) else older.step,
            )

    def _switch(self, plan: LoadPlan, chosen: ReadPlan | int) -> None:
        """Point the reader at the step chosen for the same ``plan``, if that step can serve it."""
        bad = self._resolved
        step = chosen.step if isinstance(chosen, ReadPlan) else chosen
        new = dict(self._step_metadata(chosen).storage_data or {})
        why = plan_misfit(plan, self._storage, new)
        if why is not None:
            raise misfit_error(self._require_namespace(), bad, step, why)
        self._storage = new

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Copy every item of ``plan`` out of the step's files, from the read plan's source (a
        failed read from the peers is read again the daemon's way)."""
        storage = self._storage
        found = [storage.get(i.storage_index) for i in plan.items]  # each item's, looked up once
        refs = [ref for ref in found if ref is not None]
        try:
            with self.open_files(refs) as files:
                self._copy_items(plan, planner, files, found)
        except (IntegrityError, PeerUnavailableError) as e:
            source = self._plan.source if self._plan is not None else None
            report(self._daemon, self.namespace, self._resolved, e, source)
            instead = self._plan.instead() if self._plan is not None else None
            if instead is None:
                raise
            # Every peer's copy failed (all bytes are read before any item is handed on): the
            # daemon tries its own way, other replicas and then the persistent tier.
            logger.warning(
                "%s/step %s: reading it from the peers failed (%s); the daemon brings it into "
                "memory instead",
                self.namespace,
                self._resolved,
                e,
            )
            try:
                with self.open_files(refs, instead) as files:
                    self._copy_items(plan, planner, files, found)
            except IntegrityError as again:
                report(self._daemon, self.namespace, self._resolved, again, instead)
                raise
        self.read_bytes = sum(ref.length for ref in refs)
        self.fetched_bytes = sum(ref.length for ref in refs if ref.file in self._fetched)

    @contextlib.contextmanager
    def open_files(
        self, refs: list[ShardRef] | None = None, source: Source | None = None
    ) -> Iterator[StepFiles]:
        """Yield the files of the step ``read_metadata`` chose, from the source it planned (or
        ``source``): the daemon's memory (pinned meanwhile; of a step spanning nodes, what
        ``refs`` need of files other nodes hold is fetched first, whole or as ranges), the peers
        or the persistent tier straight into the tensors, or downloaded and verified from the
        persistent tier when there is no daemon."""
        namespace = self._require_namespace()
        step = self._resolved
        if step is None or self._plan is None:
            raise StepStateError("the step's files are opened after read_metadata()")
        source = source or self._plan.source
        with source.open_files(namespace, step, list(refs or ())) as files:
            self._fetched = files.fetched
            yield files

    def _copy_items(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        files: StepFiles,
        refs: list[ShardRef | None],
    ) -> None:
        """Copy every item of ``plan`` out of the step's stored files; ``refs``: where each item
        is stored (None: not in the step)."""
        where = files.where
        # Of the items looked at for the prefetch: the destination where it takes the stored
        # data whole (thousands of items a load: each found once).
        targets: list[torch.Tensor | None] = [None] * len(refs)
        whole = [False] * len(refs)
        looked = files.prefetches
        if looked:  # reads straight from the persistent tier or peers: all at once
            wants: list[tuple[ShardRef, torch.Tensor | None]] = []
            for i, (item, ref) in enumerate(zip(plan.items, refs, strict=True)):
                if ref is None:
                    continue
                target = None
                if item.type != LoadItemType.BYTE_IO and ref.dtype is not None:
                    target = targets[i] = _destination(planner, item)
                    whole[i] = takes_whole(item, ref, target)
                    if not whole[i]:
                        target = None
                wants.append((ref, target))
            files.prefetch(wants)
        for i, (item, ref) in enumerate(zip(plan.items, refs, strict=True)):
            if ref is None:
                raise CheckpointFormatError(f"{where}: no stored data for {item.storage_index.fqn}")
            if item.type == LoadItemType.BYTE_IO:
                data = files.read_bytes(ref.file, ref.offset, ref.length, item.storage_index.fqn)
                planner.load_bytes(item, io.BytesIO(data))
                continue
            if ref.dtype is None or ref.shape is None:
                raise CheckpointFormatError(
                    f"{where}: {item.storage_index.fqn} is stored as bytes, not a tensor"
                )
            dtype = DTYPES[ref.dtype]
            target = targets[i]
            if target is None:
                target = _destination(planner, item)
            if (whole[i] if looked else takes_whole(item, ref, target)) and files.read_into(
                ref.file, ref.offset, ref.length, target
            ):
                planner.commit_tensor(item, target)
                continue
            raw = files.region(ref.file, ref.offset, ref.length, item.storage_index.fqn)
            src = (
                raw.view(dtype).view(ref.shape)
                if ref.length
                else torch.empty(ref.shape, dtype=dtype)
            )
            src = narrow_tensor_by_index(src, item.storage_offsets, item.lengths)
            if target.size() != src.size():
                raise CheckpointFormatError(
                    f"{where}: {item.storage_index.fqn} region has shape {list(src.size())}, the "
                    f"destination {list(target.size())}"
                )
            if target.device.type == "cuda" and self.config.pin_memory:
                _arena.pin_holding(raw)  # a DMA out of the tier file, not through bounce buffers
            copy_tensor(target, src)
            planner.commit_tensor(item, target)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_daemon"] = DaemonClient.shared(self.config)
        state["process_group"] = None
        state["_planner"] = planner = Planner(state["_daemon"], self.config)
        # A step read elsewhere is read from this node's memory there (its sources hold
        # connections and threads that do not travel).
        state["_plan"] = planner.in_memory(self._resolved) if self._resolved is not None else None
        state["_agreement"] = None
        return state
