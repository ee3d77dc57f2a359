"""``tierckpt``: the operator CLI for the checkpoints of this node's daemon and the persistent tier.

``main`` (the console script) and the argument parser are in :mod:`.main`; the commands are grouped
in :mod:`.listing` (status, ls, inspect), :mod:`.manage` (rm, persist, prefetch, export) and
:mod:`.verify`; :mod:`._render` draws tables and progress bars, :mod:`._tiers` reads the persistent
tier. Exit codes are listed in ``tierckpt --help``.
"""

from __future__ import annotations

from tierckpt_client.cli.main import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, main

__all__ = ["EXIT_ERROR", "EXIT_NOT_FOUND", "EXIT_OK", "EXIT_USAGE", "main"]
