"""``UPLOADS_PENDING``: a daemon that stopped with uploads unfinished says so in its tier directory.

The uploads resume when a daemon starts on the same tier directory (committed steps marked
``persist_pending`` are queued again). Whoever removes the directory after the daemon stopped (the
Slurm wrapper's cleanup, an operator) would lose those steps for good: the file tells it to keep
the directory. A stopping daemon writes it before it drains its uploads (a SIGKILL during the
drain leaves it too) and removes it when the drain finished; a daemon that starts on the
directory removes it once no upload waits.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

PENDING_FILE = "UPLOADS_PENDING"


def write_pending(root: Path, steps: list[str]) -> None:
    """Write the file (the steps, one a line); an error is logged (the WARNING said it all)."""
    text = "".join(f"{s}\n" for s in steps) or "queued uploads\n"
    path = root / PENDING_FILE
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # whatever was there: a link is replaced, never written through
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640
        )
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError as e:
        logger.error("could not write %s: %s", path, e)


def clear_pending(root: Path) -> None:
    """At start: the uploads the file names are queued again by this daemon."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / PENDING_FILE)
