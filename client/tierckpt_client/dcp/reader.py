"""``TieredStorageReader``: DCP storage reader that loads from the node-local daemon's memory tier."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import uuid
from collections.abc import Callable, Iterator
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
from tierckpt_client.dcp._direct import DirectTier
from tierckpt_client.dcp._ids import format_checkpoint_id, is_checkpoint_id, parse_checkpoint_id
from tierckpt_client.dcp._metadata_codec import DTYPES, ShardRef, decode_metadata
from tierckpt_client.errors import (
    CheckpointFormatError,
    DaemonUnavailableError,
    NotFoundError,
    StepNotFoundError,
    StepStateError,
    TierCkptError,
    error_from_code,
)
from tierckpt_client.protocol import validate_namespace, validate_step

logger = logging.getLogger(__name__)

# A rank that needs at most this much of a file another node holds fetches just those ranges.
RANGED_READ_MAX = 4 << 20


class TieredStorageReader(StorageReader):
    """Load DCP checkpoints through the node's daemon: from memory, or from the persistent tier.

    Args:
        namespace: the job's namespace; may come from ``checkpoint_id="tierckpt://<namespace>[/<step>]"``.
        step: the step to load; ``None`` loads the newest step that is committed in memory or
            durable in the persistent tier and verifies (older ones are tried, with a warning, when
            a newer one is corrupt or incomplete). Rank 0 of ``process_group`` decides and
            broadcasts it, so all ranks load the same step.
        config: how to reach the daemon (default :meth:`ClientConfig.from_env`).
        process_group: the group ``dcp.load`` runs on (default: the default group); only used to
            agree on the step when ``step`` is ``None``.

    Call order, as DCP drives it::

        reset(checkpoint_id)        all ranks (only when a checkpoint_id is passed)
        read_metadata()             all ranks: resolve the step (agreed across ranks); have the
                                    daemon hydrate it from the persistent tier if it is not in
                                    memory; fetch its metadata
        set_up_storage_reader()     all ranks
        prepare_local_plan()        all ranks: tag the plan with the step this rank resolved
        prepare_global_plan()       coordinator: check every rank resolved the same step
        read_data()                 all ranks: pin the step, map its files, copy each requested
                                    region into the destination tensor, unpin

    Tensors are stored raw (dtype, shape and offset in the metadata), so reading a tensor is a view
    of the mapped file and one copy into the destination; resharding narrows the stored chunk to
    the requested region first. Only bytes items (non-tensor state) go through ``torch.load``.

    Without a reachable daemon, and with ``config.persist_url`` set (``TIERCKPT_PERSIST_URL``), the
    reader reads the persistent tier itself: same format, every file verified.
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
        self._resolved: int | None = None
        self._storage: dict[Any, ShardRef] = {}
        self._direct: DirectTier | None = None
        self.load_id = uuid.uuid4().hex
        # What this rank's last read_data read: bytes of stored items, and of those the bytes in
        # files its node's daemon had to fetch from other nodes first.
        self.read_bytes = 0
        self.fetched_bytes = 0
        self._fetched: set[str] = set()

    # -- identity ---------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._resolved = None
        self._direct = None
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
            return self.step
        if not (dist.is_available() and dist.is_initialized()):
            return self._newest_good_step(namespace)
        group = self.process_group
        src = dist.get_global_rank(group, 0) if group is not None else 0
        box: list[Any] = [None]
        if dist.get_rank(group) == 0:
            try:
                box[0] = ("step", self._newest_good_step(namespace))
            except TierCkptError as e:
                box[0] = ("error", e.code, str(e))
        dist.broadcast_object_list(box, src=src, group=group)
        decision = box[0]
        if decision[0] == "error":
            raise error_from_code(
                decision[1], f"rank 0 could not resolve the latest step: {decision[2]}"
            )
        return int(decision[1])

    def _newest_good_step(self, namespace: str) -> int:
        """The newest step in memory or durable that is complete and verifies; older ones are
        tried when a newer one is corrupt or incomplete, with a warning naming the step."""
        if self._direct is not None:
            return self._direct.newest_good_step(namespace)
        try:
            candidates = self._daemon.candidates(namespace)
        except DaemonUnavailableError as e:
            return self._go_direct(e).newest_good_step(namespace)
        skipped: list[str] = []
        for cand in candidates:
            if cand.in_memory:
                return cand.step
            try:
                self._daemon.hydrate(namespace, cand.step)
            except (CheckpointFormatError, NotFoundError) as e:
                logger.warning("%s: skipping step %d for an older one: %s", namespace, cand.step, e)
                skipped.append(f"step {cand.step}: {e}")
                continue
            return cand.step
        raise StepNotFoundError(
            f"namespace {namespace}: no step could be restored ({'; '.join(skipped)})"
        )

    def _memory_metadata(self, namespace: str, step: int) -> dict[str, Any]:
        """The step's metadata from the daemon, which first brings the step into memory (from a
        peer or the persistent tier) if it is not there."""
        try:
            return self._daemon.metadata(namespace, step)
        except NotFoundError:
            self._daemon.hydrate(namespace, step)
            return self._daemon.metadata(namespace, step)

    def _go_direct(self, cause: DaemonUnavailableError) -> DirectTier:
        """No daemon: read the persistent tier ourselves, if this process knows where it is."""
        url = self.config.persist_url
        if not url:
            raise cause
        if self._direct is None:
            logger.warning(
                "%s; restoring straight from the persistent tier %s (TIERCKPT_PERSIST_URL)",
                cause,
                url,
            )
            self._direct = DirectTier(url)
        return self._direct

    # -- StorageReader ----------------------------------------------------------------------
    # No **kwargs on purpose: DCP then does not retry with rank-local metadata (which tierckpt
    # does not have), and the user sees this reader's error rather than a second, misleading one.
    def read_metadata(self) -> Metadata:
        namespace = self._require_namespace()
        step = self._resolve_step()
        self._resolved = step
        doc: dict[str, Any] | None = None
        if self._direct is None:
            try:
                doc = self._memory_metadata(namespace, step)
            except DaemonUnavailableError as e:
                self._go_direct(e)
        if self._direct is not None:
            doc = self._direct.manifest(namespace, step).metadata
        assert doc is not None
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
        return replace(plan, storage_data=self._resolved)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = {p.storage_data for p in plans}
        if len(steps) > 1:
            raise StepStateError(
                f"{self.namespace}: ranks resolved different steps {sorted(map(str, steps))}; pass "
                "process_group= to TieredStorageReader (the group dcp.load runs on) or an explicit step"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        refs = [ref for i in plan.items if (ref := self._storage.get(i.storage_index))]
        with self.open_files(refs) as files:
            self._copy_items(plan, planner, files)
        self.read_bytes = sum(ref.length for ref in refs)
        self.fetched_bytes = sum(ref.length for ref in refs if ref.file in self._fetched)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @contextlib.contextmanager
    def open_files(self, refs: list[ShardRef] | None = None) -> Iterator[_Files]:
        """Yield the files of the step ``read_metadata`` chose: in the daemon's memory (pinned
        meanwhile), or downloaded and verified from the persistent tier when there is no daemon.
        Of a step spanning nodes, files that other nodes hold and that ``refs`` (what this rank
        reads) need come first: whole into this node's memory, or, when the rank needs only a
        little of one (a replicated scalar written by a rank on another node), just those
        ranges, fetched in blocks the daemon verifies."""
        needed = {ref.file for ref in refs or ()}
        namespace = self._require_namespace()
        step = self._resolved
        if step is None:
            raise StepStateError("the step's files are opened after read_metadata()")
        where = f"{namespace}/step {step}"
        if self._direct is not None:
            direct = self._direct
            yield _Files(where, lambda name: direct.fetch(namespace, step, name), {})
            return
        try:
            pin = self._daemon.pin(namespace, step)
        except NotFoundError:  # evicted since read_metadata, or another node: bring it back
            self._daemon.hydrate(namespace, step)
            pin = self._daemon.pin(namespace, step)
        self._fetched = needed - set(pin.paths)
        wants: dict[str, list[tuple[int, int]]] = {}
        for ref in refs or ():
            if ref.file in self._fetched:
                wants.setdefault(ref.file, []).append((ref.offset, ref.length))
        whole = {n for n, r in wants.items() if sum(length for _, length in r) > RANGED_READ_MAX}
        if whole:  # held by other nodes and needed in bulk: the daemon brings them here first
            self._daemon.unpin(namespace, step, pin.pin_id)
            self._daemon.hydrate(namespace, step, sorted(whole))
            pin = self._daemon.pin(namespace, step)
        ranged: dict[str, dict[tuple[int, int], bytes]] = {}
        for name, ranges in wants.items():
            if name in whole:
                continue
            unique = sorted(set(ranges))
            data = self._daemon.read_ranges(namespace, step, name, unique)
            parts, at = {}, 0
            for off, length in unique:
                parts[(off, length)] = data[at : at + length]
                at += length
            ranged[name] = parts

        def mapped(name: str) -> torch.Tensor:
            return _arena.map_file(pin.paths[name]).buffer

        files = _Files(where, mapped, pin.paths, ranged)
        try:
            yield files
        finally:
            files.close()
            try:
                self._daemon.unpin(namespace, step, pin.pin_id)
            except TierCkptError as e:
                logger.warning(
                    "%s/step %d: could not unpin: %s (it expires by itself)", namespace, step, e
                )

    def _copy_items(self, plan: LoadPlan, planner: LoadPlanner, files: _Files) -> None:
        """Copy every item of ``plan`` out of the step's stored files."""
        where = files.where
        for item in plan.items:
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
            target = planner.resolve_tensor(item).detach()
            whole = list(item.lengths) == list(ref.shape) and not any(item.storage_offsets)
            if (
                whole
                and target.dtype == dtype
                and list(target.size()) == list(ref.shape)
                and files.read_into(ref.file, ref.offset, ref.length, target)
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
            target.copy_(src)
            planner.commit_tensor(item, target)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_daemon"] = DaemonClient.shared(self.config)
        state["process_group"] = None
        state["_direct"] = None
        return state


class _Files:
    """The stored files of one step, as ``region(file, offset, length)`` uint8 tensors, plus a
    faster way for whole tensors from a tier file this process has not mapped yet.

    A new mapping of a tier file costs a page-table entry per 4 KiB (``MAP_POPULATE``: ~0.3 s per
    GiB here, more than the copy), so the first restore after a hydration reads whole, contiguous
    destination tensors with ``preadv`` straight from the file instead. A file this process has
    mapped before (it saved the step, or restored it already) is copied from its mapping.
    """

    def __init__(
        self,
        where: str,
        load: Callable[[str], torch.Tensor],
        paths: dict[str, str],
        ranged: dict[str, dict[tuple[int, int], bytes]] | None = None,
    ) -> None:
        self.where = where
        self._load = load
        self._paths = paths  # empty: no local files (direct from the persistent tier)
        self._ranged = ranged or {}  # parts of files other nodes hold, fetched and verified
        self._buffers: dict[str, torch.Tensor] = {}
        self._fds: dict[str, int] = {}

    def buffer(self, name: str) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            if self._paths and name not in self._paths:
                raise CheckpointFormatError(
                    f"{self.where}: metadata names file {name}, which the step does not have"
                )
            buf = self._buffers[name] = self._load(name)
        return buf

    def region(self, name: str, offset: int, length: int, what: str) -> torch.Tensor:
        if name in self._ranged:
            part = self._ranged[name].get((offset, length))
            if part is None:
                raise CheckpointFormatError(f"{self.where}: {what} of {name} was not fetched")
            return (
                torch.frombuffer(bytearray(part), dtype=torch.uint8)
                if length
                else torch.empty(0, dtype=torch.uint8)
            )
        buf = self.buffer(name)
        if offset + length > buf.numel():
            raise CheckpointFormatError(f"{self.where}: {what} lies beyond the end of {name}")
        return buf[offset : offset + length]

    def read_bytes(self, name: str, offset: int, length: int, what: str) -> bytes:
        if name in self._ranged:
            return self.region(name, offset, length, what).numpy().tobytes()
        fd = self._unmapped_fd(name)
        if fd is None:
            return self.region(name, offset, length, what).numpy().tobytes()
        self._check_range(fd, name, offset, length, what)
        return os.pread(fd, length, offset) if length else b""

    def read_into(self, name: str, offset: int, length: int, target: torch.Tensor) -> bool:
        """Read ``length`` bytes at ``offset`` of file ``name`` into ``target`` if that is the
        faster way (an unmapped tier file, a contiguous CPU target of that size); else False."""
        if (
            target.device.type != "cpu"
            or not target.is_contiguous()
            or target.numel() * target.element_size() != length
        ):
            return False
        fd = self._unmapped_fd(name)
        if fd is None:
            return False
        self._check_range(fd, name, offset, length, "a tensor")
        if not length:
            return True
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        done = 0
        while done < length:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointFormatError(f"{self.where}: {name} ended early")
            done += n
        return True

    def _unmapped_fd(self, name: str) -> int | None:
        """An open descriptor of tier file ``name`` if this process has no mapping of it."""
        path = self._paths.get(name)
        if path is None or name in self._buffers:
            return None
        fd = self._fds.get(name)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            if _arena.is_mapped(fd):
                os.close(fd)
                self.buffer(name)
                return None
            self._fds[name] = fd
        return fd

    def _check_range(self, fd: int, name: str, offset: int, length: int, what: str) -> None:
        if offset + length > os.fstat(fd).st_size:
            raise CheckpointFormatError(f"{self.where}: {what} lies beyond the end of {name}")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buffers.clear()
