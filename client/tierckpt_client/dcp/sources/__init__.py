"""Where a load reads a step from: one :class:`~base.Source` per place, each yielding the step's
files as :class:`~base.StepFiles` (a step's files, read by range).

- ``memory``: this node's memory tier, through its daemon (pinned files);
- ``peers``: the peers that hold the step, straight into the tensors;
- ``persistent``: the persistent tier, straight into the tensors (or, without a daemon, whole);
- ``files`` and ``streamed``: the two kinds of ``StepFiles`` (read here, or received range by
  range and verified as each block lands).

Which one a load uses is chosen once, by ``dcp.read_plan``.
"""

from __future__ import annotations

from tierckpt_client.dcp.sources.base import MemoryFill, Source, StepFiles
from tierckpt_client.dcp.sources.memory import RANGED_READ_MAX, MemorySource
from tierckpt_client.dcp.sources.peers import PeerSource
from tierckpt_client.dcp.sources.persistent import PersistentSource

__all__ = [
    "RANGED_READ_MAX",
    "MemoryFill",
    "MemorySource",
    "PeerSource",
    "PersistentSource",
    "Source",
    "StepFiles",
]
