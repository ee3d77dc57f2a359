"""docs/settings.md is generated from the settings classes; it must match the code."""

from __future__ import annotations

import runpy
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_settings_reference_matches_the_code() -> None:
    generator = runpy.run_path(str(DOCS / "gen_settings.py"))
    expected = generator["render"]()
    committed = (DOCS / "settings.md").read_text()
    assert committed == expected, (
        "docs/settings.md is out of date with DaemonSettings / ClientConfig: regenerate it with "
        f"`{generator['COMMAND']}` and commit the result"
    )


def test_every_daemon_setting_is_listed() -> None:
    from tierckpt_daemon.config import DaemonSettings

    text = (DOCS / "settings.md").read_text()
    for name, field in DaemonSettings.model_fields.items():
        if not field.exclude:
            assert f"`TIERCKPT_{name.upper()}`" in text
