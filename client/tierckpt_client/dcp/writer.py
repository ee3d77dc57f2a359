"""``TieredStorageWriter``: DCP storage writer (and async stager) backed by the node-local daemon."""

from __future__ import annotations

import io
import logging
import os
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
from tierckpt_client.dcp._ids import format_checkpoint_id, is_checkpoint_id, parse_checkpoint_id
from tierckpt_client.dcp._metadata_codec import ShardRef, dtype_name, encode_metadata
from tierckpt_client.dcp._staging import align, stage_into, staging_size
from tierckpt_client.errors import (
    CheckpointFormatError,
    InvalidNameError,
    StepStateError,
    TierCkptError,
)
from tierckpt_client.protocol import CommitRequest, SealFile, validate_namespace, validate_step

logger = logging.getLogger(__name__)


@dataclass
class _Staged:
    """The file that ``stage()`` filled: leased from the daemon, sealed by ``write_data``."""

    lease_id: str
    path: str
    dev: int
    ino: int
    size: int


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

    Call order, as DCP drives it (``async_save`` adds ``stage`` in the trainer first)::

        stage(state_dict)            trainer, blocking: lease a file, copy every tensor into it
        reset(checkpoint_id)         all ranks (only when a checkpoint_id is passed)
        set_up_storage_writer()      all ranks
        prepare_local_plan()         all ranks
        prepare_global_plan()        coordinator: tags all plans with a fresh save attempt id
        write_data()                 all ranks: record where each item lives; bytes items and any
                                     tensor that was not staged are copied into a second file;
                                     the rank's files are sealed into the step
        finish()                     coordinator: commit the step with its metadata

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
    ) -> None:
        super().__init__()
        self.namespace = validate_namespace(namespace) if namespace is not None else None
        self.step = validate_step(step) if step is not None else None
        self.persist = persist
        self.config = config or ClientConfig.from_env()
        self._daemon = DaemonClient(self.config)
        self._staged: _Staged | None = None
        self._attempt: str | None = None
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
        state["_daemon"] = DaemonClient(self.config)  # a fresh connection in the other process
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
        lease = self._daemon.lease(namespace, rank, size)
        try:
            mapping = _arena.map_file(lease.path)
            result = stage_into(state_dict, mapping)
        except BaseException:
            self._release_quietly(namespace, lease.lease_id)
            raise
        self._staged = _Staged(lease.lease_id, lease.path, mapping.dev, mapping.ino, lease.size)
        return result.state_dict

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Give back a staged file that was never written (a save that failed before write_data)."""
        if self._staged is not None and self.namespace is not None:
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
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        attempt = uuid.uuid4().hex[:16]
        return [replace(p, storage_data=attempt) for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        namespace, step = self._require_target()
        attempt = plan.storage_data
        if not isinstance(attempt, str):
            raise StepStateError(f"{namespace}/step {step}: the save plan carries no attempt id")
        staged, self._staged = self._staged, None
        staged_mapping: _arena.FileMapping | None = None
        if staged is not None:
            staged_mapping = _arena.map_file(staged.path)
        results: list[WriteResult] = []
        pending: list[tuple[MetadataIndex, Any]] = []  # items to copy into the extra file
        staged_used = False
        data_name = f"r{self.rank:05d}.data"
        extra_name = f"r{self.rank:05d}.extra"
        leases: list[str] = [staged.lease_id] if staged is not None else []
        try:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    if not isinstance(data, io.BytesIO):
                        raise CheckpointFormatError(
                            f"{item.index.fqn}: the planner resolved a bytes item to "
                            f"{type(data).__name__}, not io.BytesIO"
                        )
                    pending.append((item.index, data.getvalue()))
                    continue
                if not isinstance(data, torch.Tensor):
                    raise CheckpointFormatError(
                        f"{item.index.fqn}: the planner resolved a tensor item to {type(data).__name__}"
                    )
                t = data.detach()
                nbytes = t.numel() * t.element_size()
                ref = None
                if staged_mapping is not None and t.device.type == "cpu" and t.is_contiguous():
                    hit = _arena.find(t.data_ptr(), nbytes) if nbytes else None
                    if hit is not None and hit[0] is staged_mapping:
                        ref = ShardRef(
                            data_name, hit[1], nbytes, dtype_name(t.dtype), tuple(t.shape)
                        )
                        staged_used = True
                if ref is None:
                    pending.append((item.index, t))
                else:
                    results.append(
                        WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=ref)
                    )
            extra_results, extra_file, copied = self._write_extra(
                namespace, extra_name, pending, leases
            )
            results.extend(extra_results)
            files = []
            if staged is not None and staged_used:
                files.append(SealFile(lease_id=staged.lease_id, name=data_name, length=staged.size))
            elif staged is not None:
                self._release_quietly(namespace, staged.lease_id)
                leases.remove(staged.lease_id)
            if extra_file is not None:
                files.append(extra_file)
            # Sealed even when empty: the attempt must exist on the daemon for the commit.
            self._daemon.seal(namespace, step, attempt, self.rank, files)
            self._attempt = attempt
        except BaseException:
            for lease_id in leases:
                self._release_quietly(namespace, lease_id)
            raise
        self.last_stats = SaveStats(
            staged_bytes=sum(r.size_in_bytes for r in results if r.storage_data.file == data_name),
            copied_bytes=copied,
            bytes_items=sum(1 for _, v in pending if not isinstance(v, torch.Tensor)),
        )
        if copied:
            logger.debug(
                "%s/step %d rank %d: copied %d unstaged tensor bytes",
                namespace,
                step,
                self.rank,
                copied,
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_extra(
        self,
        namespace: str,
        name: str,
        pending: list[tuple[MetadataIndex, Any]],
        leases: list[str],
    ) -> tuple[list[WriteResult], SealFile | None, int]:
        """Copy bytes items and unstaged tensors into one more leased file."""
        if not pending:
            return [], None, 0
        sizes = [
            v.numel() * v.element_size() if isinstance(v, torch.Tensor) else len(v)
            for _, v in pending
        ]
        total = sum(align(n) for n in sizes)
        lease = self._daemon.lease(namespace, self.rank, max(total, 1))
        leases.append(lease.lease_id)
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
        return results, SealFile(lease_id=lease.lease_id, name=name, length=offset), copied

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        namespace, step = self._require_target()
        storage = {}
        files: set[str] = set()
        for rank_results in results:
            for r in rank_results:
                storage[r.index] = r.storage_data
                files.add(r.storage_data.file)
        metadata.storage_data = storage
        # Every rank sealed under the attempt id that prepare_global_plan handed out.
        attempt = self._attempt
        if attempt is None:
            raise StepStateError(f"{namespace}/step {step}: finish() without write_data()")
        req = CommitRequest(
            files=sorted(files),
            metadata=encode_metadata(metadata),
            world_size=len(results),
            persist=self.persist,
        )
        self._daemon.commit(namespace, step, attempt, req)
