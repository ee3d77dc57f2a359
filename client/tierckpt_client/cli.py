"""``tierckpt``: look at and manage the checkpoints that the node's tierckpt daemon holds.

Talks to the daemon over its Unix socket (``TIERCKPT_SOCKET``, or ``--socket``). Human tables by
default, ``--json`` for scripts; progress of long operations (``persist --wait``, ``prefetch``) goes
to stderr. Exit codes: 0 ok, 1 daemon error (also: ``persist --wait`` timed out), 2 usage error,
3 not found, 4 daemon unavailable.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from tierckpt_client import __version__
from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import (
    DaemonUnavailableError,
    InvalidNameError,
    NotFoundError,
    TierCkptError,
)
from tierckpt_core.protocol import (
    NamespaceInfo,
    PersistentStatus,
    ReplicationStatus,
    StepCandidate,
    StepInfo,
    StepState,
    validate_namespace,
    validate_step,
)

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
        f"persistent  {_persistent_line(st.persistent)}",
        f"replication {_replication_line(st.replication)}",
    ]
    if st.persistent is not None:
        lines += [
            f"            hydrating {h.namespace} step {h.step}: "
            f"{_size(h.done_bytes)} of {_size(h.total_bytes)}"
            for h in st.persistent.hydrations
        ]
    lines += ["", _namespaces_table(st.namespaces)]
    _emit(args, st.model_dump(mode="json"), "\n".join(lines))


def _persistent_line(p: PersistentStatus | None) -> str:
    if p is None:
        return "none (memory tier only; TIERCKPT_PERSIST_URL is not set)"
    health = {True: "healthy", False: "UNHEALTHY", None: "health unknown"}[p.healthy]
    return (
        f"{p.url}, {health}, {p.queued_steps} step(s) queued, {p.uploaded_steps} uploaded "
        f"({_size(p.uploaded_bytes)}), {p.failed_uploads} failed upload(s), "
        f"last error: {p.last_error or '-'}"
    )


def _replication_line(r: ReplicationStatus | None) -> str:
    if r is None:
        return "off (TIERCKPT_PEERS is not set)"
    down = f", UNREACHABLE: {', '.join(r.unreachable)}" if r.unreachable else ""
    return (
        f"as {r.node} to {r.replicas} of peers {', '.join(p for p in r.peers if p != r.node) or '-'}"
        f"{down}, {r.queued_steps} step(s) queued, {r.replicated_steps} pushed "
        f"({_size(r.replicated_bytes)}), {r.received_steps} received, {r.failed_pushes} failed "
        f"round(s), last error: {r.last_error or '-'}"
    )


def cmd_ls(client: DaemonClient, args: argparse.Namespace) -> None:
    if args.namespace is None:
        namespaces = client.namespaces()
        docs = [ns.model_dump(mode="json") for ns in namespaces]
        _emit(args, docs, _namespaces_table(namespaces))
        return
    ns = validate_namespace(args.namespace)
    try:
        steps = client.steps(ns)
    except NotFoundError:
        steps = []  # nothing in memory; the persistent tier may still hold steps
    try:
        candidates = {c.step: c for c in client.candidates(ns)}
    except TierCkptError:
        if not steps:
            raise  # not found anywhere (exit 3), or the persistent tier is broken (exit 1)
        candidates = {}  # the memory tier's answer stands on its own
    rows_by_step: list[tuple[int, dict[str, Any]]] = []
    for s in steps:
        doc = s.model_dump(mode="json")
        doc["tiers"] = _tiers(s, candidates.get(s.step))
        rows_by_step.append((s.step, doc))
    in_memory = {s.step for s in steps}
    for c in candidates.values():
        if c.step not in in_memory and (c.durable or c.peers):
            rows_by_step.append((c.step, _not_in_memory(ns, c)))
    rows_by_step.sort(key=lambda x: x[0])
    now = time.time()
    rows = [
        (
            d["step"],
            d["state"],
            "-" if d["bytes"] is None else _size(d["bytes"]),
            len(d["files"]) if d["in_memory"] else "-",
            _age(d["committed_at"] or d["created_at"], now),
            ",".join(d["tiers"]),
            _replicas_cell(d),
        )
        for _, d in rows_by_step
    ]
    text = _table(("STEP", "STATE", "SIZE", "FILES", "AGE", "TIERS", "REPLICAS"), rows)
    _emit(args, [d for _, d in rows_by_step], text)


def _tiers(info: StepInfo, cand: StepCandidate | None) -> list[str]:
    durable = info.state == StepState.DURABLE or (cand is not None and cand.durable)
    on_peers = bool(info.replicated_to) or (cand is not None and bool(cand.peers))
    return ["memory"] + (["peers"] if on_peers else []) + (["persistent"] if durable else [])


def _replicas_cell(doc: dict[str, Any]) -> str:
    if doc.get("origin"):
        return f"replica of {doc['origin']}"
    held = ",".join(doc.get("replicated_to") or [])
    if doc.get("replication_pending"):
        return f"{held} (pending)" if held else "pending"
    return held or "-"


def _not_in_memory(ns: str, cand: StepCandidate) -> dict[str, Any]:
    """A step this node does not hold but a peer or the persistent tier does (``tierckpt
    prefetch`` brings it back)."""
    return {
        "namespace": ns,
        "step": cand.step,
        "state": StepState.DURABLE.value if cand.durable else StepState.COMMITTED.value,
        "bytes": None,
        "files": [],
        "created_at": None,
        "committed_at": None,
        "world_size": None,
        "persist": None,
        "in_memory": False,
        "replicated_to": list(cand.peers),
        "replication_pending": False,
        "origin": None,
        "tiers": (["peers"] if cand.peers else []) + (["persistent"] if cand.durable else []),
    }


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
        f"replicas    {_replicas_cell(info.model_dump())}",
        "",
    ]
    rows = [
        (f.rank, f.name, _size(f.held_bytes), f.length)
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


class _Progress:
    """One status line on stderr: redrawn in place on a terminal, else a line every few seconds."""

    def __init__(self, interval_s: float = 3.0) -> None:
        self.tty = sys.stderr.isatty()
        self.interval_s = interval_s
        self._last = 0.0
        self._width = 0

    def show(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            pad = " " * max(0, self._width - len(text))
            sys.stderr.write(f"\r{text}{pad}")
            self._width = len(text)
        elif force or now - self._last >= self.interval_s:
            sys.stderr.write(text + "\n")
            self._last = now
        sys.stderr.flush()

    def done(self, text: str) -> None:
        self.show(text, force=True)
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _bar(done: int, total: int, width: int = 30) -> str:
    frac = min(1.0, done / total) if total else 1.0
    filled = round(frac * width)
    return f"[{'#' * filled}{'.' * (width - filled)}] {100 * frac:3.0f}%"


def cmd_persist(client: DaemonClient, args: argparse.Namespace) -> None:
    ns, step = validate_namespace(args.namespace), validate_step(args.step)
    info = client.persist(ns, step)
    if args.wait and info.state != StepState.DURABLE:
        info = _wait_durable(client, ns, step, args.timeout)
    if info.state == StepState.DURABLE:
        text = f"{ns} step {step} is durable"
    else:
        text = f"{ns} step {step} queued for upload (tierckpt ls {ns} shows when it is durable)"
    _emit(args, info.model_dump(mode="json"), text)


def _wait_durable(client: DaemonClient, ns: str, step: int, timeout_s: float) -> StepInfo:
    progress = _Progress()
    t0 = time.monotonic()
    while True:
        info = client.step(ns, step)
        elapsed = time.monotonic() - t0
        if info.state == StepState.DURABLE:
            progress.done(f"{ns} step {step}: durable after {elapsed:.1f}s")
            return info
        p = client.status().persistent
        queued = p.queued_steps if p is not None else 0
        error = p.last_error if p is not None else None
        msg = f"{ns} step {step}: uploading, {queued} step(s) in the upload queue, {elapsed:.0f}s"
        progress.show(msg + (f" (retrying after: {error})" if error else ""))
        if elapsed > timeout_s:
            progress.done(msg)
            why = f": {error}" if error else f" ({queued} step(s) still queued)"
            raise TierCkptError(f"{ns} step {step} is not durable after {timeout_s:.0f}s{why}")
        time.sleep(0.2)


def cmd_prefetch(client: DaemonClient, args: argparse.Namespace) -> None:
    ns = validate_namespace(args.namespace)
    if args.step == "latest":
        step = client.candidates(ns)[0].step  # what a restore's "latest" would pick
    else:
        step = validate_step(_int(args.step))
    result: list[StepInfo] = []
    failure: list[BaseException] = []

    def hydrate() -> None:
        try:
            # A client of its own: the main thread keeps polling status on the other one.
            with DaemonClient(client.config) as own:
                result.append(own.hydrate(ns, step))
        except BaseException as e:  # re-raised in the main thread
            failure.append(e)

    worker = threading.Thread(target=hydrate, name="tierckpt-prefetch", daemon=True)
    progress = _Progress()
    progress.show(f"prefetch {ns} step {step}: starting", force=True)
    t0 = time.monotonic()
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
        if not worker.is_alive():
            break
        try:
            p = client.status().persistent
        except TierCkptError:
            continue  # a slow status answer must not end the prefetch
        for h in p.hydrations if p is not None else []:
            if (h.namespace, h.step) == (ns, step):
                progress.show(
                    f"prefetch {ns} step {step}: {_bar(h.done_bytes, h.total_bytes)} "
                    f"{_size(h.done_bytes)} / {_size(h.total_bytes)}"
                )
    if failure:
        if progress.tty:
            sys.stderr.write("\n")
        raise failure[0]
    info = result[0]
    total = sum(f.length for f in info.files)
    progress.done(
        f"prefetch {ns} step {step}: {_bar(total, total)} {_size(total)} / {_size(total)} "
        f"in memory after {time.monotonic() - t0:.1f}s"
    )
    text = f"{ns} step {step} is in memory ({info.state.value}, {_size(info.bytes)})"
    _emit(args, info.model_dump(mode="json"), text)


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

    s = sub.add_parser(
        "status", parents=[common], help="capacity, usage, pool, persistent tier and namespaces"
    )
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
    s = sub.add_parser(
        "persist", parents=[common], help="upload a committed step to the persistent tier now"
    )
    s.add_argument("namespace", metavar="NAMESPACE")
    s.add_argument("step", type=int, metavar="STEP")
    s.add_argument("--wait", action="store_true", help="wait until the step is durable")
    s.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="with --wait: give up (exit 1) after this long (default 3600)",
    )
    s.set_defaults(func=cmd_persist)
    s = sub.add_parser(
        "prefetch",
        parents=[common],
        help="bring a durable step from the persistent tier into memory ahead of a restart",
    )
    s.add_argument("namespace", metavar="NAMESPACE")
    s.add_argument("step", metavar="STEP", help="a step number or 'latest'")
    s.set_defaults(func=cmd_prefetch)
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
