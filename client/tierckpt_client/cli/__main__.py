"""``python -m tierckpt_client.cli``."""

from __future__ import annotations

import sys

from tierckpt_client.cli.main import main

sys.exit(main())
