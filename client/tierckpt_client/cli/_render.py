"""Output of the ``tierckpt`` CLI: tables and progress bars (rich), sizes and ages, JSON.

Results go to stdout (a table, or JSON with ``--json``); progress and warnings go to stderr, so
``tierckpt --json ... | jq`` sees only the document. A reader that goes away early (``| head``)
ends the command quietly (:class:`StdoutClosed`), as Unix tools do.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

WIDE = 250  # columns for a table written to a pipe: a script wants whole lines, not wrapped cells
OUTPUTS = ("table", "json", "wide", "name")


@dataclass
class Options:
    """How results are shown (kubectl's habits): ``-o table|json|wide|name``, ``--no-headers``,
    ``-q`` (no progress, warnings or confirmation lines on stderr/stdout; errors still go to
    stderr). Set once by main() before a command runs."""

    output: str = "table"
    no_headers: bool = False
    quiet: bool = False


OPTIONS = Options()


class StdoutClosed(Exception):
    """The reader of stdout went away (EPIPE); main() exits quietly."""


class NoNamesError(ValueError):
    """``-o name`` asked of a command whose result has no names (a usage error, exit 2)."""


def size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, units = n / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while value >= 1024 and len(units) > 1:
        value, units = value / 1024, units[1:]
    return f"{value:.1f} {units[0]}"


def age(since: float | None, now: float) -> str:
    if not since:
        return "-"
    s = max(0.0, now - since)
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if s < limit:
            return f"{s / div:.0f}{unit}"
    return f"{s / 86400:.0f}d"


def opt(value: object) -> str:
    return "-" if value is None else str(value)


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    wide: tuple[Sequence[str], Sequence[Sequence[object]]] | None = None,
) -> str:
    """A borderless table as text: header row (unless ``--no-headers``), then one line per row,
    columns aligned. ``wide``: more columns (headers, one tuple per row) for ``-o wide``."""
    if wide is not None and OPTIONS.output == "wide":
        headers = [*headers, *wide[0]]
        rows = [[*row, *more] for row, more in zip(rows, wide[1], strict=True)]
    t = Table(
        box=None,
        pad_edge=False,
        header_style=None,
        show_edge=False,
        show_header=not OPTIONS.no_headers,
    )
    for h in headers:
        t.add_column(h, no_wrap=True)
    for row in rows:
        t.add_row(*(str(c) for c in row))
    buf = io.StringIO()
    Console(file=buf, width=WIDE, color_system=None, highlight=False).print(t)
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def write_stdout(text: str) -> None:
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed from None


def emit(json_mode: bool, doc: Any, text: str, *, names: Sequence[str] | None = None) -> None:
    """The command's result: JSON (``--json``, ``-o json``), its ``names`` one per line (``-o
    name``), or ``text`` (a table, ``-o wide`` with more columns)."""
    if json_mode or OPTIONS.output == "json":
        write_stdout(json.dumps(doc, indent=2))
    elif OPTIONS.output == "name":
        if names is None:
            raise NoNamesError("-o name: this command's result has no names; use -o json")
        if names:
            write_stdout("\n".join(names))
    else:
        write_stdout(text)


def done(json_mode: bool, doc: Any, text: str) -> None:
    """The result of a command that changes something: a confirmation line (none with ``-q``)."""
    if json_mode or OPTIONS.output == "json" or not OPTIONS.quiet:
        emit(json_mode, doc, text, names=[])


def warn(message: str) -> None:
    if not OPTIONS.quiet:
        print(f"tierckpt: warning: {message}", file=sys.stderr)


def note(message: str) -> None:
    """A progress line on stderr (none with ``-q``)."""
    if not OPTIONS.quiet:
        print(message, file=sys.stderr)


def byte_progress() -> Progress:
    """A progress bar on stderr with bytes done/total, rate and ETA. Redrawn in place on a
    terminal; elsewhere (a log file, CI) rich draws nothing and the caller prints a final line."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True, highlight=False),
        transient=False,
        disable=OPTIONS.quiet,
    )
