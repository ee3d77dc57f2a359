"""Pointer files: the one-line stand-ins for checkpoints at the paths a framework chooses.

A framework that finds its checkpoints by listing a folder (Lightning's ``ckpt_path="last"``)
keeps doing so: the file at the path holds ``tierckpt://<namespace>/<step>``, or
``tierckpt://<namespace>`` for "the newest step". Framework-free.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from tierckpt_client.dcp.ids import SCHEME, format_checkpoint_id, parse_checkpoint_id

logger = logging.getLogger(__name__)

POINTER_MAX = 4096  # a pointer file is one short line; anything larger is not one of ours
LAST_PREFIX = "last"  # Lightning's ModelCheckpoint.CHECKPOINT_NAME_LAST
_LIGHTNING_META = "meta.pt"  # the file that marks a folder as Lightning's own sharded checkpoint


def read_pointer(path: str | os.PathLike[str]) -> str | None:
    """The tierckpt id a pointer file at ``path`` names, or None if ``path`` is not one."""
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size > POINTER_MAX:
            return None
        text = p.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return text if text.startswith(SCHEME) and "\n" not in text else None


def warn_other_namespace(namespace: str, path: str, checkpoint_id: str) -> None:
    """Say so when the pointer at ``path`` names a step of another namespace than the one the
    run saves into (a misspelt namespace beside an old folder: the run resumed from the other
    job's step, then saved into its own, and only Lightning's "Restored all states" was said)."""
    named, _ = parse_checkpoint_id(checkpoint_id)
    if named != namespace:
        logger.warning(
            "%s names %s, a step of namespace %r; this run saves into namespace %r: it resumes "
            "from the other job's step (pass ckpt_path=%r to resume from this job's own)",
            path,
            checkpoint_id,
            named,
            namespace,
            format_checkpoint_id(namespace, None),
        )


def pointer_id(namespace: str, path: Path, step: int) -> str:
    """What the pointer at ``path`` names: the step, or the newest step for ``last*`` names."""
    return format_checkpoint_id(namespace, None if path.name.startswith(LAST_PREFIX) else step)


def write_pointer(path: Path, checkpoint_id: str) -> None:
    """Write the pointer atomically: a reader on another node of a shared folder never sees half
    of one."""
    if path.is_dir():
        if not (path / _LIGHTNING_META).is_file():
            raise IsADirectoryError(f"the checkpoint path exists and is a directory: {path}")
        shutil.rmtree(path)  # Lightning's own sharded checkpoint of that name, replaced as it does
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(checkpoint_id + "\n", encoding="utf-8")
    os.replace(tmp, path)
