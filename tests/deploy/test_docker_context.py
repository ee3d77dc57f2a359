"""What the Dockerfile copies is in the build context: `.dockerignore` leaves out everything
else (`*`, then `!` for each path the image needs), so a path the Dockerfile copies and the
ignore file does not bring back fails `docker build` at that step (webhook/ did)."""

from __future__ import annotations

import fnmatch
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rules() -> list[tuple[bool, str]]:
    """(include, pattern) of .dockerignore, in order (the last matching rule decides)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        rules.append((include, line.lstrip("!").rstrip("/")))
    return rules


def _in_context(path: str, rules: list[tuple[bool, str]]) -> bool:
    """Docker's rule, for the paths here: a pattern matches a path or a folder above it."""
    parts = path.rstrip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    kept = True
    for include, pattern in rules:
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            kept = include
    return kept


def _copied() -> list[str]:
    """The sources of every COPY from the build context (not from another stage)."""
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = shlex.split(line.strip()) if line.strip().startswith("COPY ") else []
        if not words or any(w.startswith("--from=") for w in words):
            continue
        sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


def test_every_path_the_dockerfile_copies_is_in_the_build_context() -> None:
    rules = _rules()
    copied = _copied()
    assert {"core", "daemon", "client", "pyproject.toml"} <= set(copied)
    missing = [p for p in copied if not _in_context(p, rules)]
    assert not missing, f".dockerignore leaves out what the Dockerfile copies: {missing}"
    for p in copied:
        assert (ROOT / p).exists(), p


def test_the_context_leaves_out_what_the_image_does_not_need() -> None:
    rules = _rules()
    for p in ("tests/conftest.py", "bench/peers.py", ".git/HEAD", "client/x/__pycache__/a.pyc"):
        assert not _in_context(p, rules), p
