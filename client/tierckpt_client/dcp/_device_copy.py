"""A restore into CUDA tensors at the link's speed: host-to-device copies straight out of the tier
file's mapping (registered with CUDA: each copy a DMA), while CPU threads check the same bytes'
blocks against the checksums taken when the file was written.

The order, for the whole tensors of one load (``LocalFiles.prefetch``):

1. each tier file's mapping is registered (``_arena.pin``, once per file and process; the file
   a rank saved is already);
2. a side stream of each destination's device waits for the device's current stream (work the
   loop queued on the destinations), then takes every ``copy_(non_blocking=True)``;
3. the blocks the copies read are checked on the caller's thread and the verify helpers
   (:func:`tierckpt_core.verified_copy.check_all`), beside the DMA;
4. the side streams are synchronized, whatever happened: no copy is in flight once this
   returns or raises (the step's pin is released after, and the daemon may recycle the file).

The load returns only after 3 and 4. A block that does not match raises
``BlockMismatchError``: the destinations then hold bytes nobody vouched for, and the load fails
or, for "latest", falls back to an older step that is read into the same destinations, every
byte overwritten (``dcp/_fallback``), as for any restore found corrupt while it is read. What
is checked is the tier file's bytes, which the DMA reads at about the same time: a writer with
access to the tier racing the reader could change a block between the two (the same window a
GPU destination had before, when the tier was checked first and copied after; the tier is
writable only by the node's group, and tensors run no code: docs/security.md).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch

from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._helpers import VERIFY, on_helpers
from tierckpt_core.verified import BlockSums
from tierckpt_core.verified_copy import check_all

VERIFY_THREADS: int | None = None
"""Threads that check a load's blocks beside the DMA, the caller's included (None: torch's
intra-op threads). A knob for ``bench/gpu_staging.py``'s sweep, not a setting."""

_STREAMS: dict[int, torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()


def _stream(device: int) -> torch.cuda.Stream:
    with _STREAMS_LOCK:
        s = _STREAMS.get(device)
        if s is None:
            s = _STREAMS[device] = torch.cuda.Stream(device)
        return s


def takes_bytes(target: torch.Tensor, length: int) -> bool:
    """Whether CUDA tensor ``target`` takes ``length`` stored bytes as they are."""
    return (
        target.device.type == "cuda"
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and target.numel() * target.element_size() == length
    )


@dataclass
class DeviceCopy:
    """Bytes ``[offset, offset + length)`` of a tier file (``src``: its mapping's buffer) into
    CUDA tensor ``target``; ``blocks``: those of its blocks still to check in this load."""

    src: torch.Tensor
    sums: BlockSums
    offset: int
    target: torch.Tensor
    blocks: list[int]


def land(copies: list[DeviceCopy], *, pin: bool) -> int:
    """Run ``copies`` (module docstring); the bytes checked. BlockMismatchError."""
    if not copies:
        return 0
    if pin:
        for c in copies:
            _arena.pin_holding(c.src)
    streams: dict[int, torch.cuda.Stream] = {}
    try:
        for c in copies:
            dev = c.target.device.index if c.target.device.index is not None else 0
            side = streams.get(dev)
            if side is None:
                side = streams[dev] = _stream(dev)
                side.wait_stream(torch.cuda.current_stream(dev))
            n = c.target.numel() * c.target.element_size()
            with torch.cuda.stream(side):
                flat = c.target.reshape(-1).view(torch.uint8)
                flat.copy_(c.src[c.offset : c.offset + n], non_blocking=True)
        seen: set[tuple[str, int]] = set()
        blocks: list[tuple[Any, BlockSums, int]] = []
        for c in copies:
            view: Any = c.src.numpy()
            for b in c.blocks:
                if (c.sums.name, b) not in seen:
                    seen.add((c.sums.name, b))
                    blocks.append((view, c.sums, b))
        return check_all(
            blocks,
            threads=VERIFY_THREADS or torch.get_num_threads(),
            spawn=functools.partial(on_helpers, VERIFY),
        )
    finally:
        for side in streams.values():
            side.synchronize()
