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
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._direct import PersistentTier
from tierckpt_client.dcp._fallback import (
    FAILED,
    OK,
    Agreement,
    agree,
    agreement,
    decide,
    misfit_error,
    outcome,
    plan_misfit,
)
from tierckpt_client.dcp._files import StepFiles
from tierckpt_client.dcp._ids import format_checkpoint_id, is_checkpoint_id, parse_checkpoint_id
from tierckpt_client.dcp._metadata_codec import DTYPES, ShardRef, copy_tensor, decode_metadata
from tierckpt_client.dcp._peered import PeerTier
from tierckpt_client.dcp._streamed import MemoryFill, StreamedTier
from tierckpt_client.dcp._targets import RANGED_READ_MAX, MemoryTier, ReadSource
from tierckpt_client.errors import (
    CapacityExceededError,
    CheckpointFormatError,
    DaemonUnavailableError,
    IntegrityError,
    NotFoundError,
    PeerUnavailableError,
    PersistentTierError,
    StepStateError,
    TierCkptError,
)
from tierckpt_client.protocol import StepCandidate, validate_namespace, validate_step

logger = logging.getLogger(__name__)

__all__ = ["RANGED_READ_MAX", "TieredStorageReader"]


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
        # Where the step's files come from (see _targets): the memory tier through the daemon,
        # the persistent tier straight into the tensors for a durable step in no node's memory
        # (_streamed), or the persistent tier once the daemon turned out to be unreachable.
        self._memory = self._memory_tier(self._daemon)
        self._source: ReadSource = self._memory
        self._streamed: StreamedTier | None = None
        self._elsewhere: MemoryFill | None = None  # the last of those two a load read from
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

    def _memory_tier(self, daemon: DaemonClient) -> MemoryTier:
        return MemoryTier(
            daemon,
            verify_reads=self.config.verify_reads,
            read_direct=self._read_direct,
            peer_files=self._peer_files,
        )

    @property
    def memory_fill(self) -> threading.Thread | None:
        """After a load read straight from the persistent tier or the peers: the thread in which
        the daemon brings the step into this node's memory for the next restore (the load does
        not wait for it; ``join()`` it to). None after a load from this node's memory."""
        return self._elsewhere.filling if self._elsewhere is not None else None

    # -- identity ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._resolved = None
        self._agreement = None
        self._source = self._memory
        self._elsewhere = None
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

    # -- choosing the step ------------------------------------------------------------------
    def _resolve_step(self) -> int:
        namespace = self._require_namespace()
        if self.step is not None:
            self._agreement = None  # an explicit step: no fallback, nothing to agree on
            return self.step
        self._agreement = agreement(self.process_group)
        return self._decide(namespace, None)

    def _decide(self, namespace: str, below: int | None) -> int:
        """The newest good step (older than ``below``), the same on every rank that loads."""
        assert self._agreement is not None
        what = "the latest step" if below is None else f"a step older than {below}"
        return decide(self._agreement, lambda: self._newest_good_step(namespace, below), what)

    def _newest_good_step(self, namespace: str, below: int | None = None) -> int:
        """The newest step in memory or durable that is complete and verifies (and older than
        ``below``); older ones are tried when a newer one is corrupt or incomplete, with a
        warning naming the step."""
        try:
            return self._source.newest_good_step(namespace, below)
        except (DaemonUnavailableError, CapacityExceededError) as e:
            return self._go_direct(e).newest_good_step(namespace, below)

    def _go_direct(self, cause: TierCkptError) -> PersistentTier:
        """No daemon, or a step too large for its memory tier (saved straight to the persistent
        tier by a writer's ``on_unavailable="persist"``): read the persistent tier ourselves, if
        this process knows where it is."""
        url = self.config.persist_url
        if not url:
            raise cause
        logger.warning(
            "%s; restoring straight from the persistent tier %s (TIERCKPT_PERSIST_URL)", cause, url
        )
        source = self._source = PersistentTier(url)
        return source

    def _peer_files(self, namespace: str, step: int) -> PeerTier | None:
        """Files of a step spanning nodes that other nodes hold, which this rank needs in bulk:
        read from them straight into the tensors, if the daemon hands over connections."""
        if not self.config.reads_peers_direct():
            return None
        return PeerTier.offered(self._daemon, self.config, namespace, step)

    def _read_direct(self, namespace: str, cand: StepCandidate) -> dict[str, Any] | None:
        """A step not in this node's memory, read straight into the destination tensors
        (verified block by block) from where it is: the peers that hold it (through connections
        the daemon hands over), else, durable, the persistent tier if this process can reach it.
        The daemon brings it into memory afterwards. Returns the step's metadata, or None when
        it cannot be read from here (the daemon then brings the step into memory first)."""
        if cand.peers:  # nearer than the persistent tier
            if not self.config.reads_peers_direct():
                return None
            peers = PeerTier.offered(self._daemon, self.config, namespace, cand.step)
            if peers is None:
                return None
            logger.info(
                "%s/step %d is not in this node's memory: reading it straight from the peers "
                "that hold it (%s), verified; the daemon brings it into memory afterwards",
                namespace,
                cand.step,
                ", ".join(sorted(peers.sources.holders)),
            )
            self._source = self._elsewhere = peers
            return peers.metadata(namespace, cand.step)
        if not cand.durable or not self.config.reads_direct():
            return None
        step = cand.step
        url = self.config.persist_url
        assert url is not None
        source = self._streamed
        if source is None:
            source = self._streamed = StreamedTier(PersistentTier(url), self.config)
        try:
            doc = source.metadata(namespace, step)
        except (PersistentTierError, NotFoundError) as e:
            # Unreachable, no credentials here, or not what the daemon's tier holds: the daemon
            # reads its own tier.
            logger.warning(
                "%s/step %d: cannot read the persistent tier %s from this process (%s); the "
                "daemon brings the step into memory first",
                namespace,
                step,
                url,
                e,
            )
            return None
        logger.info(
            "%s/step %d is in no node's memory: reading it straight from %s, verified; the "
            "daemon brings it into memory afterwards",
            namespace,
            step,
            url,
        )
        self._source = self._elsewhere = source
        return doc

    # -- StorageReader ----------------------------------------------------------------------
    # No **kwargs on purpose: DCP then does not retry with rank-local metadata (which tierckpt
    # does not have), and the user sees this reader's error rather than a second, misleading one.
    def read_metadata(self) -> Metadata:
        self._require_namespace()
        # Each load starts from this node's memory (DCP calls reset() only when given a
        # checkpoint_id): a reader reused after a load from elsewhere must not stay there.
        self._source = self._memory
        self._elsewhere = None
        return self._step_metadata(self._resolve_step())

    def _step_metadata(self, step: int) -> Metadata:
        """Make ``step`` the one this reader loads, and return its metadata."""
        namespace = self._require_namespace()
        self._resolved = step
        try:
            doc = self._source.metadata(namespace, step)
        except (DaemonUnavailableError, CapacityExceededError) as e:
            doc = self._go_direct(e).metadata(namespace, step)
        metadata = decode_metadata(doc)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
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
        older: int | None = None
        while True:
            error: Exception | None = None
            try:
                if older is not None:
                    self._switch(plan, older)
                self._read_plan(plan, planner)
            except Exception as e:  # every rank must reach the agreement, whatever it met
                error = e
            status, found = agree(outcome(error), how)
            if status == OK:
                return
            if status == FAILED:  # not corruption: the load fails (the ranks that failed say why)
                if error is not None:
                    raise error
                return
            bad = self._resolved
            assert bad is not None
            corrupt.append(f"step {bad}: {'; '.join(found)}")
            if not isinstance(self._source, PersistentTier):  # the daemon's way, unless it is gone
                self._source = self._memory
            self._elsewhere = None
            try:
                older = self._decide(namespace, bad)
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
                older,
            )

    def _switch(self, plan: LoadPlan, step: int) -> None:
        """Point the reader at ``step`` for the same ``plan``, if that step can serve it."""
        bad = self._resolved
        new = dict(self._step_metadata(step).storage_data or {})
        why = plan_misfit(plan, self._storage, new)
        if why is not None:
            raise misfit_error(self._require_namespace(), bad, step, why)
        self._storage = new

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Copy every item of ``plan`` out of the step's files, from this reader's source (a
        failed read from the peers falls back to the daemon's own way)."""
        refs = [ref for i in plan.items if (ref := self._storage.get(i.storage_index))]
        try:
            with self.open_files(refs) as files:
                self._copy_items(plan, planner, files)
        except (IntegrityError, PeerUnavailableError) as e:
            if not (isinstance(self._source, PeerTier) or self._memory.read_peers):
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
            self._source = self._memory
            peer_files, self._memory.peer_files = self._memory.peer_files, None
            try:
                with self.open_files(refs) as files:
                    self._copy_items(plan, planner, files)
            finally:
                self._memory.peer_files = peer_files
        self.read_bytes = sum(ref.length for ref in refs)
        self.fetched_bytes = sum(ref.length for ref in refs if ref.file in self._fetched)

    @contextlib.contextmanager
    def open_files(self, refs: list[ShardRef] | None = None) -> Iterator[StepFiles]:
        """Yield the files of the step ``read_metadata`` chose, from this reader's source: the
        daemon's memory (pinned meanwhile; of a step spanning nodes, what ``refs`` need of files
        other nodes hold is fetched first, whole or as ranges), or downloaded and verified from
        the persistent tier when there is no daemon."""
        namespace = self._require_namespace()
        step = self._resolved
        if step is None:
            raise StepStateError("the step's files are opened after read_metadata()")
        with self._source.open_files(namespace, step, list(refs or ())) as files:
            self._fetched = files.fetched
            yield files

    def _copy_items(self, plan: LoadPlan, planner: LoadPlanner, files: StepFiles) -> None:
        """Copy every item of ``plan`` out of the step's stored files."""
        where = files.where
        targets: dict[int, torch.Tensor] = {}
        prefetch = getattr(files, "prefetch", None)
        if prefetch is not None:  # reads straight from the persistent tier: all at once
            wants: list[tuple[ShardRef, torch.Tensor | None]] = []
            for i, item in enumerate(plan.items):
                ref = self._storage.get(item.storage_index)
                if ref is None:
                    continue
                target = None
                if item.type != LoadItemType.BYTE_IO and ref.dtype is not None:
                    targets[i] = planner.resolve_tensor(item).detach()
                    if self._whole(item, ref, targets[i]):
                        target = targets[i]
                wants.append((ref, target))
            prefetch(wants)
        for i, item in enumerate(plan.items):
            ref = self._storage.get(item.storage_index)
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
            target = targets[i] if i in targets else planner.resolve_tensor(item).detach()
            if self._whole(item, ref, target) and files.read_into(
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

    @staticmethod
    def _whole(item: Any, ref: ShardRef, target: torch.Tensor) -> bool:
        """Whether ``item`` reads all of stored tensor ``ref`` into a ``target`` of its dtype
        and shape (a copy of bytes, no narrowing nor conversion)."""
        return (
            ref.dtype is not None
            and ref.shape is not None
            and list(item.lengths) == list(ref.shape)
            and not any(item.storage_offsets)
            and target.dtype == DTYPES[ref.dtype]
            and list(target.size()) == list(ref.shape)
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_daemon"] = DaemonClient.shared(self.config)
        state["process_group"] = None
        state["_memory"] = self._memory_tier(state["_daemon"])
        state["_source"] = state["_memory"]
        state["_streamed"] = None
        state["_elsewhere"] = None
        state["_agreement"] = None
        return state
