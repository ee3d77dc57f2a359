"""Which items this rank will write: remembered from the last save, so that ``stage()`` copies only
those (replicated state, see docs/design.md, "Replicated state is stored once").

DCP's planner gives every replicated item to one rank (``dedup_save_plans``), after ``stage()``
has run. The assignment is a function of every rank's plan, and plans rarely change between
steps, so each process remembers, per (daemon socket, namespace, rank), the tensors its last
save wrote, under a **fingerprint** of the state dict's layout as ``stage()`` sees it: every
leaf's DCP name, kind, dtype, shapes and (DTensor) mesh and placements, and the world size. The
next ``stage()`` with the same fingerprint copies only the remembered tensors and leaves a
``meta`` tensor of the same shape (no bytes) in place of the others, so that the planner builds
the same plan. Anything else (the first save, a changed layout, a save that did not confirm the
names) copies everything, as before.

The names are DCP's own (``flatten_state_dict``); a planner that names items otherwise (no
flattening, say) never confirms them (``prepare_local_plan`` compares), so its saves always copy
everything. When the assignment changes although this rank's layout did not (another rank's
layout changed alone, or the planner's dedup option changed between saves), ``write_data``
finds an item it must write without its bytes, fails the save with a clear error and forgets the
assignment: the next save copies everything again.

PROCESS-mode ``async_save`` writes in DCP's helper process: the helper sends the assignment back
to the trainer through a mailbox of the trainer's (``_mailbox``, as pre-leases travel), as one
line: the fingerprint and a bitmap over the sorted tensor names that the trainer kept from its
stage.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.tensor import DTensor

from tierckpt_client.dcp import _mailbox
from tierckpt_client.dcp._mailbox import Mailbox
from tierckpt_core.errors import StepStateError

logger = logging.getLogger(__name__)

Key = tuple[str, str, int]  # (daemon socket, namespace, rank)


@dataclass
class Layout:
    """What ``stage()`` saw of one state dict."""

    fingerprint: str
    names: tuple[str, ...]  # the tensor leaves' DCP names, sorted
    by_id: dict[int, list[str]] = field(default_factory=dict)  # id(leaf) -> its names


_lock = threading.Lock()
_written: dict[Key, tuple[str, frozenset[str]]] = {}  # key -> (fingerprint, names written)
_staged: dict[Key, Layout] = {}  # trainer: the layout of the last stage (to decode bitmaps)
_boxes = _mailbox.Mailboxes()  # trainer side: where helper processes send assignments


def layout_of(state_dict: dict[str, Any], rank: int, world: int) -> Layout | None:
    """The layout of ``state_dict`` by DCP's names, or None if DCP cannot flatten it."""
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        flat, _ = flatten_state_dict(state_dict)
    except Exception as e:  # an unusual state dict: stage everything, as before
        logger.debug("no layout of the state dict (%s): staging every tensor", e)
        return None
    parts: list[Any] = [world, rank]
    by_id: dict[int, list[str]] = {}
    meshes: dict[tuple[int, Any], str] = {}
    for name, v in flat.items():
        if type(v) is torch.Tensor:  # the common leaf first (none of the kinds below)
            parts.append(("T", name, str(v.dtype), tuple(v.shape), v.device.type))
            by_id.setdefault(id(v), []).append(name)
        elif isinstance(v, ShardedTensor):
            offsets = [tuple(s.metadata.shard_offsets) for s in v.local_shards()]
            parts.append(("S", name, str(v.dtype), tuple(v.shape), offsets))
        elif isinstance(v, DTensor):
            spec = v._spec
            k = (id(spec.mesh), spec.placements)
            where = meshes.get(k)
            if where is None:
                where = meshes[k] = f"{spec.mesh}{spec.placements}"
            local = v._local_tensor
            parts.append(("D", name, str(v.dtype), tuple(v.shape), tuple(local.shape), where))
            by_id.setdefault(id(v), []).append(name)
        elif isinstance(v, torch.Tensor):
            parts.append(("T", name, str(v.dtype), tuple(v.shape), v.device.type))
            by_id.setdefault(id(v), []).append(name)
        else:
            parts.append(("O", name))
    names = tuple(sorted({n for ns in by_id.values() for n in ns}))
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()
    return Layout(digest, names, by_id)


def skipped(key: Key, layout: Layout | None) -> frozenset[str]:
    """The names ``stage()`` need not copy: tensors the last save with this layout gave another
    rank (a leaf under several names is copied if this rank wrote any of them)."""
    if layout is None:
        return frozenset()
    with _lock:
        got = _written.get(key)
    if got is None or got[0] != layout.fingerprint:
        return frozenset()
    written = got[1]
    return frozenset(
        n for names in layout.by_id.values() if not written.intersection(names) for n in names
    )


def remember(key: Key, fingerprint: str, written: frozenset[str] | None) -> None:
    """What a save with ``fingerprint`` wrote here; ``None``: forget (copy everything next)."""
    with _lock:
        if written is None:
            _written.pop(key, None)
        else:
            _written[key] = (fingerprint, written)


def kept(key: Key, layout: Layout) -> None:
    """Trainer: the layout just staged, to decode what the helper process sends back."""
    with _lock:
        _staged[key] = layout


def forget_all() -> None:
    """Forget every assignment this process knows (tests)."""
    with _lock:
        _written.clear()
        _staged.clear()


# -- PROCESS mode: the helper tells the trainer ----------------------------------------------


def mailbox(key: Key) -> Mailbox:
    return _boxes.box(key)


def encode(names: tuple[str, ...], written: frozenset[str]) -> str:
    bits = bytearray((len(names) + 7) // 8)
    for i, n in enumerate(names):
        if n in written:
            bits[i // 8] |= 1 << (i % 8)
    return base64.b64encode(bytes(bits)).decode()


def decode(names: tuple[str, ...], text: str) -> frozenset[str]:
    bits = base64.b64decode(text)
    if len(bits) != (len(names) + 7) // 8:
        raise ValueError("bitmap of another layout")
    return frozenset(n for i, n in enumerate(names) if bits[i // 8] >> (i % 8) & 1)


def send(box: Mailbox, fingerprint: str, bitmap: str | None) -> bool:
    """Helper: send the trainer what this save wrote (``None``: forget it). Best effort: a
    trainer that does not hear copies everything at its next stage."""
    return _mailbox.send(box, [fingerprint, bitmap])


def collect(key: Key) -> None:
    """Trainer: take in what helper processes sent for ``key`` (no round trip)."""
    for line in _boxes.read(key, 1 << 20):
        try:
            fingerprint, bitmap = json.loads(line)
            with _lock:
                layout = _staged.get(key)
            if bitmap is None:
                remember(key, str(fingerprint), None)
            elif layout is not None and layout.fingerprint == fingerprint:
                remember(key, fingerprint, decode(layout.names, str(bitmap)))
        except (ValueError, TypeError):  # a torn or foreign line: copy everything next time
            remember(key, "", None)


# -- one save ----------------------------------------------------------------------------------


class SaveAssignment:
    """What one save's ``stage`` left out, and what the save tells the next one: a field of the
    writer (pickled with it into PROCESS mode's helper, without the leaves' identities)."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self.skipped: frozenset[str] = frozenset()
        self.key: Key | None = None
        self.names_ok = False  # the planner names the tensors as stage() did
        self.box: Mailbox | None = None  # PROCESS mode: the trainer's
        self.staged_by: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.layout is not None and self.key is not None:
            state["layout"] = Layout(self.layout.fingerprint, self.layout.names)
            state["box"] = mailbox(self.key)
        return state

    def plan(
        self, state_dict: dict[str, Any], socket: str, namespace: str, rank: int, world: int
    ) -> Callable[[torch.Tensor], bool] | None:
        """``stage``: which tensors to leave out (see the module docstring); None: none."""
        key = self.key = (socket, namespace, rank)
        self.staged_by = os.getpid()
        collect(key)  # sent by DCP's helper process (PROCESS mode)
        if world == 1:
            # No other rank to write anything: every tensor is this rank's, and the layout (a
            # walk of the whole state dict, ~5 us a tensor) would serve nothing.
            self.layout, self.skipped = None, frozenset()
            return None
        layout = self.layout = layout_of(state_dict, rank, world)
        self.skipped = skipped(key, layout)
        if layout is None:
            return None
        kept(key, layout)
        if not self.skipped:
            return None
        by_id, left_out = layout.by_id, self.skipped
        return lambda t: any(n in left_out for n in by_id.get(id(t), ()))

    def check_names(self, plan: SavePlan, where: str) -> None:
        """``prepare_local_plan``: whether the planner names this rank's tensors as ``stage``
        did (DCP's flattened names); only then may the next save leave out what another rank
        writes. A save that left tensors out under names the planner does not use fails here,
        before any rank writes: their placeholders would be saved (inside a bytes item, say)."""
        if self.layout is None:
            return
        if not plan.usable:  # plan caching: the same plan as a save whose names were confirmed
            self.names_ok = bool(self.skipped)
            return
        tensors = {i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO}
        self.names_ok = tensors == set(self.layout.names)
        if self.skipped and not self.skipped <= tensors:
            self.tell(None)
            raise StepStateError(
                f"{where}: stage() left out tensors that another rank wrote in the last save, "
                "but this save's planner names the items differently (a planner changed between "
                "saves?); the save is not committed, the next one copies every tensor again"
            )

    def check_snapshot(self, pending: list[tuple[Any, Any]], where: str) -> None:
        """``write_data``: every item this rank writes must have its bytes. An item ``stage``
        left out (another rank wrote it in the last save) that DCP gives this rank now cannot
        be saved as it was when ``async_save`` was called: the save fails, and the next one
        copies everything."""
        missing = [
            index.fqn
            for index, v in pending
            if isinstance(v, torch.Tensor) and v.device.type == "meta"
        ]
        if not missing:
            return
        self.tell(None)
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise StepStateError(
            f"{where} must write {', '.join(missing[:5])}{more}, which stage() did not copy "
            "because another rank wrote it in the last save of this layout (the assignment of "
            "replicated items changed: another rank's state dict, or the planner's dedup "
            "option, changed alone); this save is not committed, the next one copies everything"
        )

    def tell(self, plan: SavePlan | None) -> None:
        """Remember what this rank wrote (``plan``; ``None``: forget it) where the next
        ``stage`` of this rank runs: this process, or the trainer (PROCESS mode)."""
        layout, key = self.layout, self.key
        if layout is None or key is None:
            return
        written = None
        if plan is not None and self.names_ok:
            written = frozenset(i.index.fqn for i in plan.items if i.type != WriteItemType.BYTE_IO)
        if self.staged_by == os.getpid() or self.box is None:
            remember(key, layout.fingerprint, written)
        else:
            bitmap = None if written is None else encode(layout.names, written)
            send(self.box, layout.fingerprint, bitmap)
