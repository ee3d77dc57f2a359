"""Re-export of :mod:`tierckpt_core.errors` (its home since the shared core package), so that
imports from ``tierckpt_client.errors`` keep working."""

from tierckpt_core.errors import *  # noqa: F403
