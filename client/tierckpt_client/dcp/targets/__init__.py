"""Where a save's files go: one :class:`~base.SaveTarget` per place, each filling
:class:`~base.OutFile` s and committing them (the save side's mirror of ``sources``).

- ``memory``: this node's memory tier, through its daemon (leased tmpfs files, sealed, committed);
- ``persistent``: the persistent tier straight from the trainer, in the daemon's format, for a
  save that cannot use the daemon (degraded mode).

A writer holds one target per save, as torch's ``FileSystemWriter`` holds its ``fs``; which one is
decided once per save, by the coordinator's global plan. A load reads through ``sources``
instead (see ``read_plan``).
"""

from __future__ import annotations

from tierckpt_client.dcp.targets.base import OutFile, SaveTarget
from tierckpt_client.dcp.targets.memory import MemoryTier
from tierckpt_client.dcp.targets.persistent import PersistentTier

__all__ = ["MemoryTier", "OutFile", "PersistentTier", "SaveTarget"]
