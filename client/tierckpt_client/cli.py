"""``tierckpt``: look at and manage the checkpoints that the node's tierckpt daemon holds.

Talks to the daemon over its Unix socket (``TIERCKPT_SOCKET``, or ``--socket``). Human tables by
default, ``--json`` for scripts. Exit codes: 0 ok, 1 daemon error, 2 usage error, 3 not found,
4 daemon unavailable.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from tierckpt_client import __version__
from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.errors import (
    DaemonUnavailableError,
    InvalidNameError,
    NotFoundError,
    TierCkptError,
)
from tierckpt_client.protocol import NamespaceInfo, StepInfo, validate_namespace, validate_step

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_UNAVAILABLE = 4


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, units = n / 1024, ["KiB", "MiB", "GiB", "TiB"]
    while value >= 1024 and len(units) > 1:
        value, units = value / 1024, units[1:]
    return f"{value:.1f} {units[0]}"


def _age(since: float | None, now: float) -> str:
    if not since:
        return "-"
    s = max(0.0, now - since)
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if s < limit:
            return f"{s / div:.0f}{unit}"
    return f"{s / 86400:.0f}d"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def _emit(args: argparse.Namespace, doc: Any, text: str) -> None:
    print(json.dumps(doc, indent=2) if args.json else text)


def _namespaces_table(namespaces: list[NamespaceInfo]) -> str:
    if not namespaces:
        return "no namespaces"
    rows = [
        (ns.namespace, ns.steps, ns.committed_steps, _opt(ns.latest_committed), _size(ns.bytes))
        for ns in namespaces
    ]
    return _table(("NAMESPACE", "STEPS", "COMMITTED", "LATEST", "SIZE"), rows)


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def cmd_status(client: DaemonClient, args: argparse.Namespace) -> None:
    st = client.status()
    pct = 100.0 * st.used_bytes / st.capacity_bytes if st.capacity_bytes else 0.0
    lines = [
        f"daemon      {st.version} (API {st.api_version}) at {client.config.socket}",
        f"tier dir    {st.shm_dir}",
        f"capacity    {_size(st.capacity_bytes)}",
        f"used        {_size(st.used_bytes)} ({pct:.1f}%)",
        f"leased      {_size(st.leased_bytes)}",
        f"pool        {st.pool_files} files, {_size(st.pool_bytes)} (recycled for new leases)",
        f"keep last   {st.keep_last} committed steps per namespace",
        "",
        _namespaces_table(st.namespaces),
    ]
    _emit(args, st.model_dump(mode="json"), "\n".join(lines))


def cmd_ls(client: DaemonClient, args: argparse.Namespace) -> None:
    if args.namespace is None:
        namespaces = client.namespaces()
        docs = [ns.model_dump(mode="json") for ns in namespaces]
        _emit(args, docs, _namespaces_table(namespaces))
        return
    steps = client.steps(validate_namespace(args.namespace))
    now = time.time()
    rows = [
        (
            s.step,
            s.state.value,
            _size(s.bytes),
            len(s.files),
            _age(s.committed_at or s.created_at, now),
        )
        for s in steps
    ]
    text = _table(("STEP", "STATE", "SIZE", "FILES", "AGE"), rows)
    _emit(args, [s.model_dump(mode="json") for s in steps], text)


def _step_text(info: StepInfo) -> str:
    now = time.time()
    lines = [
        f"namespace   {info.namespace}",
        f"step        {info.step}",
        f"state       {info.state.value}",
        f"world size  {_opt(info.world_size)}",
        f"size        {_size(info.bytes)} in {len(info.files)} file(s)",
        f"created     {_age(info.created_at, now)} ago",
        f"committed   {_age(info.committed_at, now) + ' ago' if info.committed_at else '-'}",
        "",
    ]
    rows = [
        (f.rank, f.name, _size(f.size), f.length)
        for f in sorted(info.files, key=lambda f: (f.rank, f.name))
    ]
    lines.append(_table(("RANK", "FILE", "SIZE", "LENGTH"), rows))
    return "\n".join(lines)


def cmd_inspect(client: DaemonClient, args: argparse.Namespace) -> None:
    info = client.step(validate_namespace(args.namespace), validate_step(args.step))
    _emit(args, info.model_dump(mode="json"), _step_text(info))


def cmd_rm(client: DaemonClient, args: argparse.Namespace) -> None:
    ns, step = validate_namespace(args.namespace), validate_step(args.step)
    client.delete(ns, step)
    doc = {"namespace": ns, "step": step, "removed": True}
    _emit(args, doc, f"removed {ns} step {step}")


def cmd_export(client: DaemonClient, args: argparse.Namespace) -> None:
    from tierckpt_client.dcp.export import export_step  # needs torch, unlike the other commands

    ns = validate_namespace(args.namespace)
    step = None if args.step == "latest" else validate_step(_int(args.step))
    written = export_step(ns, step, args.dest, config=client.config)
    doc = {"namespace": ns, "step": written, "path": str(args.dest)}
    _emit(args, doc, f"exported {ns} step {written} to {args.dest} (torch FileSystemReader format)")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidNameError(f"step must be a number or 'latest', got {text!r}") from None


def _parser() -> argparse.ArgumentParser:
    # The common options work before and after the subcommand; SUPPRESS keeps a subcommand's
    # default from overwriting a value given before it (no set_defaults: the parsers share these
    # action objects, so main() fills in the defaults).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--socket", default=argparse.SUPPRESS, help="daemon Unix socket [TIERCKPT_SOCKET]"
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="JSON output for scripts"
    )
    p = argparse.ArgumentParser(
        prog="tierckpt", description=__doc__.splitlines()[0], parents=[common]
    )
    p.add_argument("--version", action="version", version=f"tierckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("status", parents=[common], help="capacity, usage, pool and namespaces")
    s.set_defaults(func=cmd_status)
    s = sub.add_parser("ls", parents=[common], help="namespaces, or the steps of one namespace")
    s.add_argument("namespace", nargs="?", metavar="NAMESPACE")
    s.set_defaults(func=cmd_ls)
    s = sub.add_parser("inspect", parents=[common], help="state and files of one step")
    s.add_argument("namespace", metavar="NAMESPACE")
    s.add_argument("step", type=int, metavar="STEP")
    s.set_defaults(func=cmd_inspect)
    s = sub.add_parser("rm", parents=[common], help="remove one committed step from memory")
    s.add_argument("namespace", metavar="NAMESPACE")
    s.add_argument("step", type=int, metavar="STEP")
    s.set_defaults(func=cmd_rm)
    s = sub.add_parser(
        "export", parents=[common], help="write a step as a plain torch DCP checkpoint directory"
    )
    s.add_argument("namespace", metavar="NAMESPACE")
    s.add_argument("step", metavar="STEP", help="a step number or 'latest'")
    s.add_argument("dest", metavar="DIR", help="an empty or new directory")
    s.set_defaults(func=cmd_export)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.socket, args.json = getattr(args, "socket", None), getattr(args, "json", False)
    try:
        config = ClientConfig.from_env(socket=args.socket)
    except ValueError as e:  # a malformed TIERCKPT_* variable
        return _fail(EXIT_USAGE, e)
    try:
        with DaemonClient(config) as client:
            args.func(client, args)
    except InvalidNameError as e:
        return _fail(EXIT_USAGE, e)
    except NotFoundError as e:
        return _fail(EXIT_NOT_FOUND, e)
    except DaemonUnavailableError as e:
        return _fail(EXIT_UNAVAILABLE, e)
    except (TierCkptError, OSError) as e:
        return _fail(EXIT_ERROR, e)
    return EXIT_OK


def _fail(code: int, error: BaseException) -> int:
    print(f"tierckpt: {error}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
