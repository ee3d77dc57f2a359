"""The package rules (docs/design.md, "Names and layout"), read statically from the source files'
imports: every ``import`` and ``from ... import``, at any depth (inside functions and
``TYPE_CHECKING`` blocks too), relative ones resolved.

- ``tierckpt_core`` (what both sides share) imports no torch, no daemon, no client: the daemon's
  image carries no torch, and the client must not pull the daemon in.
- ``tierckpt_client`` imports nothing of the daemon.
- the daemon's ``tier/`` (this node's memory) imports nothing of ``peers/`` (other nodes): the
  arrows run from ``peers/`` to ``tier/``, never back.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(package_dir: Path, package: str) -> list[tuple[str, int, str]]:
    """``(file, line, module)`` for every import in the files under ``package_dir`` (the folder of
    the dotted ``package``)."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir).with_suffix("")
        parts = [*package.split("."), *rel.parts]
        here = parts[:-1]  # the package a relative import starts from (also for __init__)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    module = ".".join([*base, node.module] if node.module else base)
                else:
                    module = node.module or ""
                # ``from pkg import sub`` may name a module: count both.
                found.append((str(path.relative_to(ROOT)), node.lineno, module))
                found += [
                    (str(path.relative_to(ROOT)), node.lineno, f"{module}.{a.name}")
                    for a in node.names
                ]
    return found


def _breaking(imports: list[tuple[str, int, str]], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        {
            f"{file}:{line} imports {module}"
            for file, line, module in imports
            if any(module == f or module.startswith(f + ".") for f in forbidden)
        }
    )


def test_the_rules_see_imports() -> None:
    """The reader finds the arrows these rules are about (a reader that finds none passes all)."""
    client = _imports(ROOT / "client" / "tierckpt_client", "tierckpt_client")
    assert _breaking(client, ("torch",)), "the client imports torch: the reader must see it"
    daemon = _imports(ROOT / "daemon" / "tierckpt_daemon", "tierckpt_daemon")
    assert _breaking(daemon, ("tierckpt_daemon.tier",)), "peers/ imports tier/: it must be seen"


def test_core_imports_no_torch_no_daemon_no_client() -> None:
    imports = _imports(ROOT / "core" / "tierckpt_core", "tierckpt_core")
    assert _breaking(imports, ("torch", "tierckpt_daemon", "tierckpt_client")) == []


def test_client_imports_nothing_of_the_daemon() -> None:
    imports = _imports(ROOT / "client" / "tierckpt_client", "tierckpt_client")
    assert _breaking(imports, ("tierckpt_daemon",)) == []


def test_the_daemons_tier_wing_imports_nothing_from_its_peers_wing() -> None:
    """``tier/`` is this node's memory and its records; ``peers/`` (everything between daemons)
    builds on it, never the other way round: the restore asks the ring through small Protocols
    (tier/restore.py), and ``node.py`` wires the two."""
    imports = _imports(ROOT / "daemon" / "tierckpt_daemon" / "tier", "tierckpt_daemon.tier")
    assert _breaking(imports, ("tierckpt_daemon.peers",)) == []


def test_the_cli_runs_with_the_base_dependencies_alone() -> None:
    """Every install ships `tierckpt` (the daemon's image runs it through `kubectl exec`): with
    none of the extras' packages importable, `tierckpt --help` still runs (a module-level
    `import tenacity` on its import path once broke it)."""
    import subprocess
    import sys

    extras = [
        "torch", "numpy", "s3torchconnector", "boto3", "botocore", "tenacity",
        "fastapi", "uvicorn", "pydantic_settings", "h11",
    ]  # fmt: skip
    code = (
        "import runpy, sys\n"
        f"for m in {extras!r}: sys.modules[m] = None\n"
        "sys.argv = ['tierckpt', '--help']\n"
        "runpy.run_module('tierckpt_client.cli', run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "verify" in proc.stdout
