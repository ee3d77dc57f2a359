"""Re-export of :mod:`tierckpt_core.objectstore` (its home since the shared core package), so that
imports from ``tierckpt_client.objectstore`` keep working."""

from tierckpt_core.objectstore import *  # noqa: F403
