"""What the daemon and its clients share: the error tree (``errors``), the wire models and name
rules (``protocol``), checksums (``integrity``), the persistent tier's layout (``layout``) and the
object stores behind it (``objectstore``), and the decoding of a daemon's HTTP answers (``http``).

Torch-free and free of both sides' code: the daemon imports this package, never
:mod:`tierckpt_client`, and the client never imports :mod:`tierckpt_daemon`.
"""

from __future__ import annotations

# The one version of the project: pyproject.toml reads it ([tool.hatch.version]), the daemon and
# the client re-export it, and tests/deploy checks the chart's appVersion and the image's label.
__version__ = "0.1.0"
