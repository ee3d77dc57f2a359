"""Re-export of :mod:`tierckpt_core.layout` (its home since the shared core package), so that
imports from ``tierckpt_client.layout`` keep working."""

from tierckpt_core.layout import *  # noqa: F403
