"""Re-export of :mod:`tierckpt_core.protocol` (its home since the shared core package), so that
imports from ``tierckpt_client.protocol`` keep working."""

from tierckpt_core.protocol import *  # noqa: F403
