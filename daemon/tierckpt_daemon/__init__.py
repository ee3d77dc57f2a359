"""tierckpt daemon: keeps DCP shards in a node-local shared-memory tier (no torch in here)."""

from __future__ import annotations

from tierckpt_core import __version__

__all__ = ["__version__"]
