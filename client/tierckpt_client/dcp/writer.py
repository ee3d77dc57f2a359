"""``TieredStorageWriter``: DCP storage writer (and async stager) backed by the node-local daemon."""

from __future__ import annotations

import io
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._direct import DirectTier
from tierckpt_client.dcp._ids import format_checkpoint_id, is_checkpoint_id, parse_checkpoint_id
from tierckpt_client.dcp._metadata_codec import ShardRef, dtype_name, encode_metadata
from tierckpt_client.dcp._staging import align, stage_into, staging_size
from tierckpt_client.errors import (
    CapacityExceededError,
    CheckpointFormatError,
    DaemonUnavailableError,
    InvalidNameError,
    StepStateError,
    TierCkptError,
)
from tierckpt_client.protocol import CommitRequest, SealFile, validate_namespace, validate_step
from tierckpt_core.integrity import block_digest

logger = logging.getLogger(__name__)

SEGMENT_MAX = 64 << 10  # items up to this size get a checksum of their own (see _segments)


@dataclass
class _Staged:
    """What ``stage()`` filled: a file leased from the daemon (sealed by ``write_data``), or, in
    degraded mode, private memory (``lease_id``/``path`` None) that ``write_data`` uploads."""

    lease_id: str | None
    path: str | None
    size: int
    private: _arena.FileMapping | None = None

    def mapping(self) -> _arena.FileMapping:
        if self.path is not None:
            return _arena.map_file(self.path)
        assert self.private is not None
        return self.private


@dataclass(frozen=True)
class _LocalPlanData:
    """What each rank tells the coordinator."""

    direct: bool  # this rank cannot use its daemon
    daemon: str  # which daemon (host and socket) holds this rank's files
    node: str | None = None  # that daemon's node name among its peers (None: it has no peers)


@dataclass(frozen=True)
class _PlanData:
    """What the coordinator hands every rank in its plan."""

    attempt: str
    direct: bool  # write straight to the persistent tier (some rank cannot use its daemon)
    across: bool = False  # the ranks use several daemons: a commit across nodes


def _segments(
    results: list[WriteResult], mapping: _arena.FileMapping, name: str
) -> list[tuple[int, int, str]]:
    """Checksums of the small items of the staged file (a save across nodes): a rank on another
    node that needs one of them (a replicated value DCP had this rank write) then fetches it
    alone, verified, instead of the whole file."""
    out = []
    for r in results:
        ref = r.storage_data
        if ref.file == name and 0 < ref.length <= SEGMENT_MAX:
            data = mapping.view(ref.offset, ref.length).numpy().tobytes()
            out.append((ref.offset, ref.length, block_digest(data)))
    return out


def _private_buffer(size: int) -> _arena.FileMapping:
    return _arena.FileMapping(
        dev=-1, ino=-1, fd=-1, size=size, buffer=torch.empty(size, dtype=torch.uint8)
    )


_warned: set[str] = set()


@dataclass(frozen=True)
class SaveStats:
    """What one rank's ``write_data`` did, for metrics and tests.

    ``copied_bytes`` counts tensor bytes that had to be copied in ``write_data`` because they were not
    staged into the tier (plain ``dcp.save``, or a planner that replaced tensors); with
    ``async_save`` it is 0.
    """

    staged_bytes: int
    copied_bytes: int
    bytes_items: int


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

    One writer serves one save at a time; use a new writer (or wait for the previous save) per save.
    """

    _synchronize_after_execute = False  # stage() is synchronous

    def __init__(
        self,
        namespace: str | None = None,
        step: int | None = None,
        *,
        persist: bool | None = None,
        config: ClientConfig | None = None,
        on_unavailable: str = "persist",
    ) -> None:
        super().__init__()
        if on_unavailable not in ("persist", "raise"):
            raise ValueError(f"on_unavailable must be 'persist' or 'raise', got {on_unavailable!r}")
        self.on_unavailable = on_unavailable
        self._direct: DirectTier | None = None
        self.namespace = validate_namespace(namespace) if namespace is not None else None
        self.step = validate_step(step) if step is not None else None
        self.persist = persist
        self.config = config or ClientConfig.from_env()
        self._daemon = DaemonClient.shared(self.config)
        self._staged: _Staged | None = None
        self._plan_data: _PlanData | None = None
        self._rank_nodes: list[str | None] | None = None  # coordinator: the node of each rank
        self.rank = 0
        self.is_coordinator = True
        self.last_stats: SaveStats | None = None
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

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_daemon"] = DaemonClient.shared(
            self.config
        )  # a fresh connection in the other process
        state["_direct"] = None
        # PROCESS-mode async_save pickles the writer right after stage() to hand the save to its
        # helper process: the staged file belongs to that copy from now on, so this one can stage
        # the next save.
        self._staged = None
        return state

    # -- AsyncStager ------------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        namespace = self._require_namespace()
        if self._staged is not None:
            raise StepStateError(
                f"{namespace}: stage() called again before the previous save was written; use one "
                "TieredStorageWriter per save, or wait for the previous save's future"
            )
        size = staging_size(state_dict)
        if size == 0:
            return stage_into(state_dict, None).state_dict
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        try:
            lease = self._daemon.lease(namespace, rank, size)
        except (DaemonUnavailableError, CapacityExceededError) as e:
            self._degrade(e)
            private = _private_buffer(size)
            result = stage_into(state_dict, private)
            self._staged = _Staged(None, None, size, private)
            return result.state_dict
        try:
            mapping = _arena.map_file(lease.path)
            result = stage_into(state_dict, mapping)
        except BaseException:
            self._release_quietly(namespace, lease.lease_id)
            raise
        self._staged = _Staged(lease.lease_id, lease.path, lease.size)
        return result.state_dict

    def _degrade(self, cause: TierCkptError) -> DirectTier:
        """Switch this save to the persistent tier, or re-raise ``cause`` if the policy says no."""
        url = self.config.persist_url
        if self.on_unavailable != "persist" or not url:
            if self.on_unavailable == "persist":
                cause.message += (
                    " (set TIERCKPT_PERSIST_URL in the trainer to save straight to the persistent "
                    "tier instead)"
                )
                cause.args = (cause.message,)
            raise cause
        key = f"{type(cause).__name__}:{url}"
        if key not in _warned:
            _warned.add(key)
            logger.warning("%s; saving straight to the persistent tier %s", cause, url)
        if self._direct is None:
            self._direct = DirectTier(url)
        return self._direct

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Give back a staged file that was never written (a save that failed before write_data)."""
        if self._staged is not None and self.namespace is not None:
            if self._staged.lease_id is not None:
                self._release_quietly(self.namespace, self._staged.lease_id)
            self._staged = None
        self._daemon.close()

    def _release_quietly(self, namespace: str, lease_id: str) -> None:
        try:
            self._daemon.release(namespace, lease_id)
        except TierCkptError as e:
            # The lease expires on the daemon by itself; the save's own error is the one to raise.
            logger.warning("%s: could not release lease %s: %s", namespace, lease_id, e)

    # -- StorageWriter ----------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        self._require_target()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        direct = self._staged is not None and self._staged.lease_id is None
        if not direct and not self._daemon.ping():
            self._degrade(
                DaemonUnavailableError(f"cannot reach the tierckpt daemon at {self.config.socket}")
            )
            direct = True
        daemon = f"{socket.gethostname()}:{self.config.socket}"
        node = None if direct else self._daemon.node()
        return replace(plan, storage_data=_LocalPlanData(direct=direct, daemon=daemon, node=node))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        namespace, step = self._require_target()
        local = [p.storage_data for p in plans]
        if not all(isinstance(x, _LocalPlanData) for x in local):
            raise StepStateError(f"{namespace}/step {step}: a rank's plan carries no writer data")
        daemons = {x.daemon for x in local}
        nodes = [x.node for x in local]
        # Ranks on several daemons: each keeps its files on its own node, and the coordinator's
        # daemon commits the step on all of them. That needs daemons that are each other's peers.
        across = len(daemons) > 1 and None not in nodes and len(set(nodes)) == len(daemons)
        self._rank_nodes = nodes if across else None
        if len(daemons) > 1 and not across and self._direct is None:
            self._degrade(
                StepStateError(
                    f"{namespace}/step {step}: the ranks use {len(daemons)} daemons (nodes), "
                    "which are not peers of each other (set TIERCKPT_PEERS, TIERCKPT_NODE_NAME "
                    "and TIERCKPT_PEER_TOKEN on every node's daemon to commit across nodes)"
                )
            )
        direct = (len(daemons) > 1 and not across) or any(x.direct for x in local)
        data = _PlanData(
            attempt=uuid.uuid4().hex[:16], direct=direct, across=self._rank_nodes is not None
        )
        if data.direct:
            self._direct_tier(namespace, step).begin(namespace, step)
        return [replace(p, storage_data=data) for p in plans]

    def _direct_tier(self, namespace: str, step: int) -> DirectTier:
        if self._direct is None:
            self._degrade(
                DaemonUnavailableError(
                    f"{namespace}/step {step}: another rank cannot use its daemon, so this save "
                    "goes to the persistent tier"
                )
            )
        assert self._direct is not None
        return self._direct

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        namespace, step = self._require_target()
        data = plan.storage_data
        if not isinstance(data, _PlanData):
            raise StepStateError(f"{namespace}/step {step}: the save plan carries no attempt id")
        staged, self._staged = self._staged, None
        staged_mapping = staged.mapping() if staged is not None else None
        results: list[WriteResult] = []
        pending: list[tuple[MetadataIndex, Any]] = []  # items to copy into the extra file
        data_name = f"r{self.rank:05d}.data"
        extra_name = f"r{self.rank:05d}.extra"
        leases: list[str] = [staged.lease_id] if staged is not None and staged.lease_id else []
        try:
            for item in plan.items:
                value = self._resolve(item, planner)
                ref = None
                if isinstance(value, torch.Tensor) and staged_mapping is not None:
                    ref = self._staged_ref(value, staged_mapping, data_name)
                if ref is None:
                    pending.append((item.index, value))
                else:
                    results.append(
                        WriteResult(index=item.index, size_in_bytes=ref.length, storage_data=ref)
                    )
            staged_used = bool(results)
            extra, extra_lease, extra_results, copied = self._pack_extra(
                namespace, extra_name, pending, direct=data.direct
            )
            if extra_lease is not None:
                leases.append(extra_lease)
            results.extend(extra_results)
            if data.direct:
                direct = self._direct_tier(namespace, step)
                if staged is not None and staged_mapping is not None and staged_used:
                    direct.put_rank_file(
                        namespace, step, self.rank, data_name, staged_mapping.buffer[: staged.size]
                    )
                if extra is not None:
                    direct.put_rank_file(namespace, step, self.rank, extra_name, extra)
                for lease_id in leases:
                    self._release_quietly(namespace, lease_id)
                leases.clear()
            else:
                files = []
                if staged is not None and staged.lease_id is not None:
                    if staged_used:
                        segments = None
                        if data.across and staged_mapping is not None:
                            segments = _segments(results, staged_mapping, data_name)
                        files.append(
                            SealFile(
                                lease_id=staged.lease_id,
                                name=data_name,
                                length=staged.size,
                                segments=segments,
                            )
                        )
                    else:
                        self._release_quietly(namespace, staged.lease_id)
                        leases.remove(staged.lease_id)
                if extra is not None and extra_lease is not None:
                    files.append(
                        SealFile(lease_id=extra_lease, name=extra_name, length=extra.numel())
                    )
                # Sealed even when empty: the attempt must exist on the daemon for the commit.
                self._daemon.seal(namespace, step, data.attempt, self.rank, files)
            self._plan_data = data
        except BaseException:
            for lease_id in leases:
                self._release_quietly(namespace, lease_id)
            raise
        self.last_stats = SaveStats(
            staged_bytes=sum(r.size_in_bytes for r in results if r.storage_data.file == data_name),
            copied_bytes=copied,
            bytes_items=sum(1 for _, v in pending if not isinstance(v, torch.Tensor)),
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    @staticmethod
    def _resolve(item: Any, planner: SavePlanner) -> torch.Tensor | bytes:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise CheckpointFormatError(
                    f"{item.index.fqn}: the planner resolved a bytes item to "
                    f"{type(data).__name__}, not io.BytesIO"
                )
            return data.getvalue()
        if not isinstance(data, torch.Tensor):
            raise CheckpointFormatError(
                f"{item.index.fqn}: the planner resolved a tensor item to {type(data).__name__}"
            )
        return data.detach()

    @staticmethod
    def _staged_ref(t: torch.Tensor, mapping: _arena.FileMapping, name: str) -> ShardRef | None:
        """Where ``t`` lives in the staged file, if stage() put it there (no copy needed)."""
        nbytes = t.numel() * t.element_size()
        if not nbytes or t.device.type != "cpu" or not t.is_contiguous():
            return None
        offset = t.data_ptr() - mapping.base
        if not 0 <= offset <= mapping.size - nbytes:
            return None
        return ShardRef(name, offset, nbytes, dtype_name(t.dtype), tuple(t.shape))

    def _pack_extra(
        self, namespace: str, name: str, pending: list[tuple[MetadataIndex, Any]], *, direct: bool
    ) -> tuple[torch.Tensor | None, str | None, list[WriteResult], int]:
        """Copy bytes items and unstaged tensors into one more file: leased from the daemon, or
        private memory when the save goes straight to the persistent tier. Returns the file's used
        bytes, its lease id, the write results and the tensor bytes copied."""
        if not pending:
            return None, None, [], 0
        sizes = [
            v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v)
            for _, v in pending
        ]
        total = max(sum(align(n) for n in sizes), 1)
        lease_id = None
        if direct:
            mapping = _private_buffer(total)
        else:
            lease = self._daemon.lease(namespace, self.rank, total)
            lease_id = lease.lease_id
            mapping = _arena.map_file(lease.path)
        results = []
        offset = 0
        copied = 0
        for (index, value), n in zip(pending, sizes, strict=True):
            dst = mapping.view(offset, n)
            if isinstance(value, torch.Tensor):
                if n:
                    dst.view(value.dtype).view(value.shape).copy_(value)
                copied += n
                ref = ShardRef(name, offset, n, dtype_name(value.dtype), tuple(value.shape))
            else:
                if n:
                    dst.copy_(torch.frombuffer(bytearray(value), dtype=torch.uint8))
                ref = ShardRef(name, offset, n)
            results.append(WriteResult(index=index, size_in_bytes=n, storage_data=ref))
            offset += align(n)
        return mapping.buffer[:offset], lease_id, results, copied

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        namespace, step = self._require_target()
        storage = {}
        files: set[str] = set()
        for rank_results in results:
            for r in rank_results:
                storage[r.index] = r.storage_data
                files.add(r.storage_data.file)
        metadata.storage_data = storage
        data = self._plan_data
        if data is None:
            raise StepStateError(f"{namespace}/step {step}: finish() without write_data()")
        if data.direct:
            self._direct_tier(namespace, step).commit(
                namespace,
                step,
                sorted(files),
                encode_metadata(metadata),
                world_size=len(results),
                committed_at=time.time(),
            )
            return
        attempt = data.attempt
        nodes = None
        if self._rank_nodes is not None:  # rank i's files are on the daemon rank i used
            nodes = {
                r.storage_data.file: self._rank_nodes[rank]
                for rank, rank_results in enumerate(results)
                for r in rank_results
            }
        req = CommitRequest(
            files=sorted(files),
            metadata=encode_metadata(metadata),
            world_size=len(results),
            persist=self.persist,
            nodes=nodes,
        )
        self._daemon.commit(namespace, step, attempt, req)
