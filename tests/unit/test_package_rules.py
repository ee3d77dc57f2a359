"""The package rules of docs/design.md, read from the code's own imports (every import
statement, also those inside functions and under TYPE_CHECKING)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, absolute (relative imports resolved against its package)."""
    package = ".".join(path.relative_to(ROOT / "daemon").with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_daemons_tier_wing_imports_nothing_from_its_peers_wing() -> None:
    """``tier/`` is this node's memory and its records; ``peers/`` (everything between daemons)
    builds on it, never the other way round: the restore asks the ring through small Protocols
    (tier/restore.py), and ``node.py`` wires the two."""
    tier = ROOT / "daemon" / "tierckpt_daemon" / "tier"
    offending = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted(tier.rglob("*.py"))
        for name in _imports(path)
        if name == "tierckpt_daemon.peers" or name.startswith("tierckpt_daemon.peers.")
    }
    assert not offending, "tier/ imports peers/: " + "; ".join(sorted(offending))
