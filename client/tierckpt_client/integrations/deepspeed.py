"""A DeepSpeed checkpoint engine that keeps each checkpoint tag as one tierckpt step.

DeepSpeed 0.19 saves through ``engine.checkpoint_engine``: ``create(info)``, then one
``save(state_dict, path)`` per file (the model states on data-parallel rank 0, one optimizer
partition per rank), then ``commit(info)`` on every rank, then rank 0 writes ``<save_dir>/latest``.
It has no configuration key for a custom engine, so :func:`install` sets it on an initialized
``DeepSpeedEngine``::

    engine, *_ = deepspeed.initialize(model=model, config=ds_config, ...)
    install(engine, "my-job")
    engine.save_checkpoint("ckpt")          # tag global_step<N> -> tierckpt://my-job/<N>
    engine.load_checkpoint("ckpt")          # the tag in ckpt/latest, read from tierckpt

What this engine does, against DeepSpeed's ``TorchCheckpointEngine``:

* ``save`` keeps the state dict (DeepSpeed does not change it before ``commit``); ``commit`` saves
  every rank's files in one collective DCP save, step ``N`` of the namespace, where ``N`` is the
  number the tag ends with (``global_step<N>``, DeepSpeed's default; a tag without one is refused
  at ``create``). Each file is stored as its tensors plus one bytes item holding the pickled
  rest of it (the "skeleton"): DCP's planners never see the file's own structure, so integer keys,
  empty containers and any non-tensor value come back exactly as saved. The skeleton is a DCP
  bytes item, not a tensor, because tierckpt's readers check bytes items against the checksum
  taken when they were written even where tensor checks are off (``TIERCKPT_VERIFY_READS=0``):
  it is unpickled, so it must never be read unverified.
* At ``commit`` every rank writes a one-line pointer file (``tierckpt://<namespace>/<N>``) at the
  path of every file of the tag, whichever rank saved it, and ``latest`` (with ``save_latest``):
  DeepSpeed's loader lists ``mp_rank_*_model_states.pt`` and reads ``latest`` from the folder, also
  where each node has its own folder. ``load(path)`` never reads the pointer: it names the step by
  the tag in the path and reads the file from tierckpt (this node's memory, a peer's, or the
  persistent tier), so any rank reads any file.
* ``zero_to_fp32.py`` (copied into the tag folder by DeepSpeed) reads real ``torch.save`` files:
  :func:`materialize` writes them for one tag.

Saves are synchronous (``is_decoupled()`` is False). Not thread-safe: the training loop calls it.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from tierckpt_client import _fresh
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp.ids import format_checkpoint_id
from tierckpt_client.integrations._pointers import write_pointer
from tierckpt_core.errors import CheckpointFormatError, NamespaceNotFoundError
from tierckpt_core.protocol import validate_namespace

logger = logging.getLogger(__name__)

_TAG_STEP = re.compile(r"(\d+)$")
SKELETON = "skeleton"  # the key suffix of a file's pickled non-tensor structure


def tag_step(tag: str) -> int:
    """The tierckpt step that holds DeepSpeed tag ``tag``: the number it ends with."""
    m = _TAG_STEP.search(str(tag))
    if m is None:
        raise CheckpointFormatError(
            f"DeepSpeed tag {tag!r} does not end with a number: tierckpt keeps a tag as a numbered "
            "step; save with tag=None (DeepSpeed's global_step<N>) or a tag ending in the step"
        )
    return int(m.group(1))


@dataclass(frozen=True)
class _TensorRef:
    """A tensor's place in a skeleton: the key it is stored under, and what torch.save keeps."""

    key: str
    parameter: bool
    requires_grad: bool


def _file_key(path: str) -> tuple[str, str]:
    """``(tag, file name)`` of a DeepSpeed checkpoint path ``<save_dir>/<tag>/<file>``."""
    p = Path(path)
    return p.parent.name, p.name


def split(name: str, state: Any) -> dict[str, torch.Tensor | bytes]:
    """The DCP entries for file ``name``: its tensors, and its pickled skeleton as bytes."""
    out: dict[str, torch.Tensor | bytes] = {}
    seen: dict[int, _TensorRef] = {}

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:  # the same tensor twice is stored once, as torch.save does
                key = f"{name}/{len(seen)}"
                out[key] = obj.detach()
                seen[id(obj)] = _TensorRef(
                    key, isinstance(obj, torch.nn.Parameter), obj.requires_grad
                )
            return seen[id(obj)]
        if type(obj) in (dict, OrderedDict):  # a dict's own subclasses are pickled as they are
            return type(obj)((k, walk(v)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(walk(v) for v in obj)
        return obj

    out[f"{name}/{SKELETON}"] = pickle.dumps(walk(state), protocol=pickle.HIGHEST_PROTOCOL)
    return out


def join(name: str, loaded: dict[str, Any]) -> Any:
    """File ``name`` rebuilt from its DCP entries (the inverse of :func:`split`); the skeleton's
    bytes must come from a tierckpt read (verified against the write-time checksum)."""
    raw = loaded[f"{name}/{SKELETON}"]
    if not isinstance(raw, bytes):
        raise CheckpointFormatError(
            f"DeepSpeed file {name!r}: its skeleton is a {type(raw).__name__}, not a bytes item "
            "(a step saved by an earlier, unreleased version of this engine): save it again"
        )
    skeleton = pickle.loads(raw)  # verified bytes: see the module's docstring

    def walk(obj: Any) -> Any:
        if isinstance(obj, _TensorRef):
            t = loaded[obj.key]
            if obj.parameter:
                return torch.nn.Parameter(t, requires_grad=obj.requires_grad)
            return t.requires_grad_(obj.requires_grad) if t.is_floating_point() else t
        if type(obj) in (dict, OrderedDict):
            return type(obj)((k, walk(v)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(skeleton)


def _map(t: torch.Tensor, map_location: Any) -> torch.Tensor:
    """``t`` (on the CPU) placed as ``torch.load(..., map_location=map_location)`` would."""
    if map_location is None:
        return t
    if callable(map_location) and not isinstance(map_location, (str, torch.device)):
        s = map_location(t.untyped_storage(), "cpu")
        if s is None or s is t.untyped_storage():
            return t
        return torch.empty(0, dtype=t.dtype, device=s.device).set_(s, 0, t.shape, t.stride())
    if isinstance(map_location, dict):
        return t.to(map_location.get("cpu", "cpu"))
    return t.to(map_location)


def read_file(namespace: str, step: int, name: str, map_location: Any = None) -> Any:
    """File ``name`` of a step, read by this rank alone (no collective)."""
    md = TieredStorageReader(namespace, step).read_metadata()
    prefix = f"{name}/"
    want: dict[str, Any] = {}
    for key, entry in md.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata):
            want[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        elif key == f"{name}/{SKELETON}" and isinstance(entry, BytesStorageMetadata):
            want[key] = b""  # DCP's planner puts the verified item here
    if f"{name}/{SKELETON}" not in want:
        raise CheckpointFormatError(
            f"{namespace}/step {step} holds no DeepSpeed file {name!r} "
            f"(it holds {sorted({k.split('/')[0] for k in md.state_dict_metadata})})"
        )
    dcp.load(
        want,
        storage_reader=TieredStorageReader(namespace, step),
        planner=DefaultLoadPlanner(allow_partial_load=True),
        no_dist=True,
    )
    return join(
        name,
        {k: _map(v, map_location) if isinstance(v, torch.Tensor) else v for k, v in want.items()},
    )


class TierckptCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine interface over one tierckpt namespace (see the module)."""

    def __init__(self, namespace: str, config_params: Any = None, *, persist: bool | None = None):
        super().__init__(config_params)
        self.name = "TierckptCheckpointEngine"
        self.namespace = validate_namespace(namespace)
        self.persist = persist
        self._tag: str | None = None
        self._files: dict[str, Any] = {}  # file name -> state dict, until commit

    def create(self, info: CheckpointCommitInfo) -> None:
        tag_step(info.tag)  # a tag tierckpt cannot number fails before anything is saved
        self._tag, self._files = info.tag, {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)  # the folders hold pointers and `latest` only

    def save(self, state_dict: Any, path: str) -> None:
        tag, name = _file_key(path)
        if self._tag is None or tag != self._tag:
            raise CheckpointFormatError(
                f"DeepSpeed saved {path} outside the tag {self._tag!r} that create() began"
            )
        self._files[name] = state_dict

    def commit(self, info: CheckpointCommitInfo) -> bool:
        step = tag_step(info.tag)
        state: dict[str, torch.Tensor | bytes] = {}
        for name, sd in self._files.items():
            state.update(split(name, sd))
        writer = TieredStorageWriter(self.namespace, step, persist=self.persist)
        dcp.save(state, storage_writer=writer)
        names = sorted(self._files)
        if dist.is_available() and dist.is_initialized():
            gathered: list[list[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, names)
            names = sorted({n for ns in gathered for n in ns or []})
        # DeepSpeed writes `latest` again on rank 0: the same tag.
        _write_folder(self.namespace, step, info.save_dir, info.tag, names, info.save_latest)
        self._tag, self._files = None, {}
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        tag, name = _file_key(path)
        return read_file(self.namespace, tag_step(tag), name, map_location)

    def preserves_storage_sharing(self) -> bool:
        return False  # each tensor is stored alone: DeepSpeed need not clone views for us


def _write_folder(
    namespace: str, step: int, save_dir: str, tag: str, names: list[str], latest: bool
) -> None:
    """The pointer at the path of every file of ``tag`` (``names``), and ``latest``."""
    folder = Path(save_dir) / tag
    folder.mkdir(parents=True, exist_ok=True)
    pointer = format_checkpoint_id(namespace, step)
    for name in names:
        write_pointer(folder / name, pointer)
    if latest:
        path = Path(save_dir) / "latest"
        tmp = path.with_name(f".latest.{os.getpid()}")
        tmp.write_text(tag)
        os.replace(tmp, path)


def install(
    engine: Any, namespace: str, *, persist: bool | None = None
) -> TierckptCheckpointEngine:
    """Make an initialized ``DeepSpeedEngine`` save and load through tierckpt. ``persist``:
    None (the default) leaves it to the daemon's policy (``TIERCKPT_PERSIST_EVERY``), as every
    other save; True asks for every tag; False keeps the tags in memory (and peers) only."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise TypeError(
            "install() needs the DeepSpeedEngine that deepspeed.initialize() returns (its first "
            f"value), not a {type(engine).__module__}.{type(engine).__qualname__}: checkpoints "
            "of anything else would be saved by DeepSpeed's own engine, not by tierckpt"
        )
    ours = TierckptCheckpointEngine(namespace, persist=persist)
    engine.checkpoint_engine = ours
    return ours


def restore_folder(namespace: str, save_dir: str | os.PathLike[str]) -> str | None:
    """Where ``save_dir`` has no ``latest`` (a replacement node's empty node-local folder, or a
    folder lost with its node), write it and the pointer files of tierckpt's newest step of
    ``namespace`` (from memory, a peer or the persistent tier, as a load of "latest" picks it),
    as tag ``global_step<N>``; returns the tag written, or None (the folder had ``latest``, or
    tierckpt holds no step of ``namespace``: a first start).

    Without it ``engine.load_checkpoint(save_dir)`` finds no ``latest`` there, logs a warning
    and returns ``(None, None)``: a loop that does not check starts again from scratch. Call it
    on every rank before ``load_checkpoint``: with torch.distributed initialized the ranks agree
    on the step (a collective, made whether or not this rank's folder has ``latest``)."""
    reader = TieredStorageReader(namespace)
    try:
        md = reader.read_metadata()
    except NamespaceNotFoundError as e:
        _fresh.starting_fresh(logger, namespace, e, what="no step in tierckpt, a first start")
        return None
    step = reader.resolved_step
    assert step is not None  # read_metadata resolved "latest" or raised
    if (Path(save_dir) / "latest").exists():
        return None
    names = sorted({key.split("/", 1)[0] for key in md.state_dict_metadata})
    tag = f"global_step{step}"
    _write_folder(namespace, step, str(save_dir), tag, names, True)
    logger.warning(
        "%s: %s had no `latest`: wrote it (%s) and its pointers from tierckpt's newest step",
        namespace,
        save_dir,
        tag,
    )
    return tag


def materialize(
    namespace: str, tag: str, folder: str | os.PathLike[str], *, files: list[str] | None = None
) -> list[Path]:
    """Write the files of tag ``tag`` as DeepSpeed's ``torch.save`` files under ``folder/tag``
    (for ``zero_to_fp32.py`` and other tools that open them); returns the paths written."""
    step = tag_step(tag)
    md = TieredStorageReader(namespace, step).read_metadata()
    names = files or sorted(
        {k.rsplit("/", 1)[0] for k in md.state_dict_metadata if k.endswith(f"/{SKELETON}")}
    )
    out = Path(folder) / tag
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        buf = io.BytesIO()
        torch.save(read_file(namespace, step, name, "cpu"), buf)
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, out / name)
        written.append(out / name)
    return written
