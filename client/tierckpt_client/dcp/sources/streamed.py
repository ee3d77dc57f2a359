"""A step's files received range by range straight into the destination tensors, each block
verified against the checksum taken when it was written (``FileRecord.blocks``) right after its last
byte landed: the ``StepFiles`` of the persistent tier (ranged GETs) and of the peers (connections
the daemon hands over), behind one :class:`RangeSource`.

The bytes of a whole, contiguous CPU tensor go from the response into the tensor itself (already
allocated and touched by the trainer). Everything else a load needs (bytes items, tensors to
reshard or to convert, tensors on a GPU) lands in private buffers, verified the same way. Reads are
ranges of whole blocks around what the rank needs, several at a time; bytes of a block that belong
to no destination are hashed as they pass and dropped. Files without block checksums are read by
the ``LocalFiles`` given as ``whole`` (downloaded whole and verified).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_client.dcp.sources._progress import Progress
from tierckpt_client.dcp.sources.files import LocalFiles
from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.manifest import FileRecord
from tierckpt_core.verified import BlockStream, BlockSums

logger = logging.getLogger(__name__)

# Ranged GETs in flight at once (each is itself split into 8 MiB parts by the CRT client, which
# runs them in parallel). 1, 2, 4 and 8 measured alike on 512 MiB in 8 files here (the CRT's own
# parallelism is enough on loopback); more than one helps a step of many small files.
CONCURRENCY = 4
# Needed spans of one file closer than this are read with one GET (the gap is hashed and dropped).
MERGE_GAP = 1 << 20
# A run at least this long is split into ``streams`` GETs when the source asks for it (peers: one
# connection's receive, copy and checks run on one core, several use several).
SPLIT_MIN = 64 << 20


@dataclass
class _Sink:
    """Bytes ``[offset, offset + len(dest))`` of a file go to ``dest``."""

    offset: int
    dest: memoryview

    @property
    def end(self) -> int:
        return self.offset + len(self.dest)


@dataclass
class _Run:
    """One ranged GET: bytes ``[lo, hi)`` of ``name`` (whole blocks), scattered into ``sinks``."""

    name: str
    lo: int
    hi: int
    sinks: list[_Sink] = field(default_factory=list)


class RangeSource(Protocol):
    """Where :class:`StreamedFiles` reads from: the persistent tier's ``ObjectStore``, or
    ``peers.PeerRanges`` (peers, through connections the daemon hands over)."""

    def get_range(
        self, key: str, start: int, end: int, put: Callable[[memoryview, int], None]
    ) -> None:
        """Call ``put(chunk, offset)`` for bytes ``[start, end)`` of ``key``, in order; on a
        retry it starts again at ``start``."""
        ...


def _bytes_of(t: torch.Tensor) -> memoryview:
    array: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


class StreamedFiles:
    """A step's files received range by range (the ``StepFiles`` of the persistent tier and of the
    peers), from a :class:`RangeSource`: :meth:`prefetch` lands whole tensors in their destinations and everything else
    in private buffers, all verified, before the reader copies anything."""

    def __init__(
        self,
        where: str,
        store: RangeSource,
        keys: dict[str, str],
        records: dict[str, FileRecord],
        whole: LocalFiles,
        *,
        concurrency: int = CONCURRENCY,
        streams: int = 1,
        others_elsewhere: bool = False,
        source: str = "in the persistent tier",
        remedy: str = "restore an older step, or this one from a node that still holds it in memory",
    ) -> None:
        self.where = where
        self._store = store
        self._streams = max(1, streams)  # GETs a long run is split into (whole blocks each)
        # Files not in ``records`` are ``whole``'s (this node's memory, when this reads only the
        # files other nodes hold), not an error.
        self._others_elsewhere = others_elsewhere
        self._source = source
        self._remedy = remedy
        self._keys = keys
        self._records = records
        self._whole = whole  # files without block checksums (downloaded whole, verified), and
        # with others_elsewhere the files this does not read
        self._concurrency = max(1, concurrency)
        self._filled: set[tuple[str, int, int, int]] = set()  # (file, offset, length, data_ptr)
        self._parts: dict[tuple[str, int, int], bytearray] = {}
        self.fetched: set[str] = set()  # files other nodes held: none here
        self.verified_bytes = 0  # bytes of blocks checked
        self.direct_bytes = 0  # bytes that landed straight in a destination tensor
        self._lock = threading.Lock()
        self._progress = Progress(where, 0)  # of the current prefetch

    prefetches = True  # the reader announces everything it reads, then copies

    # -- the StepFiles interface ----------------------------------------------------------------
    def region(self, name: str, offset: int, length: int, what: str) -> torch.Tensor:
        if self._blockless(name, offset, length, what):
            return self._whole.region(name, offset, length, what)
        if not length:
            return torch.empty(0, dtype=torch.uint8)
        part = self._parts.get((name, offset, length))
        if part is None:  # not announced to prefetch: read it now
            self.prefetch([(ShardRef(file=name, offset=offset, length=length), None)])
            part = self._parts[(name, offset, length)]
        return torch.frombuffer(part, dtype=torch.uint8)

    def read_bytes(self, name: str, offset: int, length: int, what: str) -> bytes:
        if self._blockless(name, offset, length, what):
            return self._whole.read_bytes(name, offset, length, what)
        return self.region(name, offset, length, what).numpy().tobytes()

    def read_into(self, name: str, offset: int, length: int, target: torch.Tensor) -> bool:
        """Whether :meth:`prefetch` already put (and verified) these bytes in ``target``."""
        if self._blockless(name, offset, length, "a tensor"):
            return self._whole.read_into(name, offset, length, target)
        return (name, offset, length, target.data_ptr()) in self._filled or (
            length == 0 and target.numel() == 0
        )

    def close(self) -> None:
        self._parts.clear()
        self._filled.clear()
        self._whole.close()

    # -- reading ------------------------------------------------------------------------------
    def _record(self, name: str) -> FileRecord:
        rec = self._records.get(name)
        if rec is None:
            raise CheckpointFormatError(
                f"{self.where}: metadata names file {name}, which the step does not have"
            )
        return rec

    def _blockless(self, name: str, offset: int, length: int, what: str) -> bool:
        """Whether ``name`` is read by the other ``StepFiles`` (``whole``): it has no block
        checksums, or (``others_elsewhere``) it is not one of this reader's files."""
        if self._others_elsewhere and name not in self._records:
            return True
        rec = self._record(name)
        if offset < 0 or length < 0 or offset + length > rec.length:
            raise CheckpointFormatError(f"{self.where}: {what} lies beyond the end of {name}")
        return not (rec.blocks and rec.block_size)

    def prefetch(self, wants: list[tuple[ShardRef, torch.Tensor | None]]) -> None:
        """Read what a load needs: each ``(ref, target)`` straight into ``target`` when it is a
        contiguous CPU tensor of exactly ``ref.length`` bytes, else into a private buffer that
        :meth:`region` and :meth:`read_bytes` then serve."""
        sinks: dict[str, list[_Sink]] = {}
        for ref, target in wants:
            if self._blockless(ref.file, ref.offset, ref.length, "an item") or not ref.length:
                continue
            if (
                target is not None
                and target.device.type == "cpu"
                and target.is_contiguous()
                and target.numel() * target.element_size() == ref.length
            ):
                key = (ref.file, ref.offset, ref.length, target.data_ptr())
                if key in self._filled:
                    continue
                self._filled.add(key)
                dest = _bytes_of(target)
                self.direct_bytes += ref.length
            else:
                if (ref.file, ref.offset, ref.length) in self._parts:
                    continue
                buf = self._parts[(ref.file, ref.offset, ref.length)] = bytearray(ref.length)
                dest = memoryview(buf)
            sinks.setdefault(ref.file, []).append(_Sink(ref.offset, dest))
        runs = [run for name, found in sinks.items() for run in self._runs(name, found)]
        if not runs:
            return
        total = sum(run.hi - run.lo for run in runs)
        self._progress = Progress(f"{self.where}: reading {self._source}", total)
        if len(runs) == 1 or self._concurrency == 1:
            for run in runs:
                self._fetch(run)
            self._progress.finish()
            return
        with concurrent.futures.ThreadPoolExecutor(
            min(self._concurrency, len(runs)), thread_name_prefix="tierckpt-get"
        ) as pool:
            futures = [pool.submit(self._fetch, run) for run in runs]
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            for fut in futures:
                fut.cancel()
            for fut in futures:
                if not fut.cancelled():
                    fut.result()
        self._progress.finish()

    def _runs(self, name: str, sinks: list[_Sink]) -> list[_Run]:
        """Whole-block spans around ``sinks``, those close together merged into one GET."""
        rec = self._records[name]
        size = rec.block_size
        assert size
        runs: list[_Run] = []
        for s in sorted(sinks, key=lambda s: (s.offset, s.end)):
            lo = s.offset // size * size
            hi = min(rec.length, -(-s.end // size) * size)
            if runs and lo <= runs[-1].hi + MERGE_GAP:
                run = runs[-1]
                run.hi = max(run.hi, hi)
            else:
                run = _Run(name, lo, hi)
                runs.append(run)
            run.sinks.append(s)
        if self._streams == 1:
            return runs
        pieces: list[_Run] = []
        for run in runs:  # a long run: several GETs at once, each whole blocks
            if run.hi - run.lo < SPLIT_MIN:
                pieces.append(run)
                continue
            per = -(-(run.hi - run.lo) // self._streams // size) * size
            for lo in range(run.lo, run.hi, per):
                hi = min(lo + per, run.hi)
                pieces.append(
                    _Run(name, lo, hi, [s for s in run.sinks if s.offset < hi and s.end > lo])
                )
        return pieces

    def _fetch(self, run: _Run) -> None:
        """One run from the store, scattered into its sinks; each block checked where it landed
        (the first sink it went to, else the store's buffer), as its last byte lands."""
        rec = self._records[run.name]
        sums = BlockSums.of(
            rec,
            where=self.where,
            source=self._source,
            remedy=f"the stored step is corrupt; {self._remedy}",
        )
        stream = BlockStream(sums, run.lo, run.hi)
        sinks = run.sinks  # sorted by offset
        state: dict[str, Any] = {}

        def put(view: memoryview, off: int) -> None:
            self._progress.add(len(view))
            if off == run.lo:  # the first chunk (again, when the store retried the GET)
                stream.restart()
                state.update(next=0, active=[])
            end = off + len(view)
            pos = off
            active: list[_Sink] = state["active"]
            while pos < end:
                while state["next"] < len(sinks) and sinks[state["next"]].offset <= pos:
                    active.append(sinks[state["next"]])
                    state["next"] += 1
                active[:] = [s for s in active if s.end > pos]
                stop = end
                if state["next"] < len(sinks):
                    stop = min(stop, sinks[state["next"]].offset)
                for s in active:
                    stop = min(stop, s.end)
                src = view[pos - off : stop - off]
                if active:
                    for s in active:
                        s.dest[pos - s.offset : stop - s.offset] = src
                    first = active[0]
                    stream.update(first.dest[pos - first.offset : stop - first.offset])
                else:
                    stream.update(src)
                pos = stop

        self._store.get_range(self._keys[run.name], run.lo, run.hi, put)
        with self._lock:
            self.verified_bytes += stream.checked
