"""Re-export of :mod:`tierckpt_core.integrity` (its home since the shared core package), so that
imports from ``tierckpt_client.integrity`` keep working."""

from tierckpt_core.integrity import *  # noqa: F403
