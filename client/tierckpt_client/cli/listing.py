"""``status``, ``ls`` and ``inspect``: what this node's memory tier and the persistent tier hold.

Every step is shown with the tiers that hold it (``memory``, ``peers``, ``persistent``), including
steps and whole namespaces that only the persistent tier holds.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tierckpt_client.cli import _render as r
from tierckpt_client.cli import attempts
from tierckpt_client.cli._tiers import Persistent
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import (
    NotFoundError,
    PersistentTierError,
    StepNotFoundError,
    TierCkptError,
)
from tierckpt_core.layout import StepManifest
from tierckpt_core.protocol import (
    AttemptInfo,
    PersistentStatus,
    ReplicationStatus,
    StepCandidate,
    StepInfo,
    StepState,
    validate_namespace,
    validate_step,
)


def cmd_status(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    st = client.status()
    pct = 100.0 * st.used_bytes / st.capacity_bytes if st.capacity_bytes else 0.0
    lines = [
        f"daemon      {st.version} (API {st.api_version}) at {client.config.socket}",
        f"tier dir    {st.shm_dir}",
        f"capacity    {r.size(st.capacity_bytes)}",
        f"used        {r.size(st.used_bytes)} ({pct:.1f}%)",
        f"leased      {r.size(st.leased_bytes)}",
        f"pool        {st.pool_files} files, {r.size(st.pool_bytes)} (recycled for new leases)",
        f"keep last   {st.keep_last} committed steps per namespace",
        "health      "
        + (f"UNHEALTHY: {'; '.join(st.failed_threads)}" if st.failed_threads else "ok"),
        f"persistent  {_persistent_line(st.persistent)}",
        f"replication {_replication_line(st.replication)}",
    ]
    if st.persistent is not None:
        lines += [
            f"            {what} {h.namespace} step {h.step}: "
            f"{r.size(h.done_bytes)} of {r.size(h.total_bytes)}"
            for what, progress in (
                ("uploading", st.persistent.uploads),
                ("hydrating", st.persistent.hydrations),
            )
            for h in progress
        ]
        lines += [f"            waiting: {w}" for w in st.persistent.waiting]
    lines += ["", _memory_table([ns.model_dump(mode="json") for ns in st.namespaces])]
    r.emit(args.json, st.model_dump(mode="json"), "\n".join(lines))


def _memory_table(docs: list[dict[str, Any]]) -> str:
    """The namespaces in this daemon's memory (``status``): no DURABLE or TIERS column, which
    need the persistent tier's listing (``tierckpt ls``)."""
    if not docs:
        return "no namespaces in memory"
    rows = [
        (
            d["namespace"],
            d["steps"],
            d["committed_steps"],
            r.opt(d["latest_committed"]),
            r.size(d["bytes"]),
        )
        for d in docs
    ]
    table = r.table(("NAMESPACE", "STEPS", "COMMITTED", "LATEST", "SIZE"), rows)
    return table + "\n(in this node's memory; `tierckpt ls` adds the persistent tier)"


def _persistent_line(p: PersistentStatus | None) -> str:
    if p is None:
        return "none (memory tier only; TIERCKPT_PERSIST_URL is not set)"
    health = {True: "healthy", False: "UNHEALTHY", None: "health unknown"}[p.healthy]
    return (
        f"{p.url}, {health}, {p.queued_steps} step(s) queued, {p.uploaded_steps} uploaded "
        f"({r.size(p.uploaded_bytes)}), {p.failed_uploads} failed upload(s), "
        f"{p.skipped_uploads} skipped, "
        f"last error: {p.last_error or '-'}"
    )


def _replication_line(rep: ReplicationStatus | None) -> str:
    if rep is None:
        return "off (TIERCKPT_PEERS is not set)"
    down = f", UNREACHABLE: {', '.join(rep.unreachable)}" if rep.unreachable else ""
    others = ", ".join(p for p in rep.peers if p != rep.node) or "-"
    return (
        f"as {rep.node} to {rep.replicas} of peers {others}{down}, {rep.queued_steps} step(s) "
        f"queued, {rep.replicated_steps} pushed ({r.size(rep.replicated_bytes)}), "
        f"{rep.received_steps} received, {rep.failed_pushes} failed round(s), "
        f"{rep.skipped_steps} skipped, "
        f"last error: {rep.last_error or '-'}"
    )


def _namespaces_table(docs: list[dict[str, Any]]) -> str:
    if not docs:
        return "no namespaces"
    rows = [
        (
            d["namespace"],
            d["steps"],
            d["committed_steps"],
            r.opt(d.get("durable_steps")),
            r.opt(d["latest_committed"]),
            r.size(d["bytes"]),
            ",".join(d.get("tiers", ["memory"])),
        )
        for d in docs
    ]
    return r.table(("NAMESPACE", "STEPS", "COMMITTED", "DURABLE", "LATEST", "SIZE", "TIERS"), rows)


def cmd_ls(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    if args.cluster:
        _ls_cluster(client, args)
    elif args.namespace is None:
        _ls_namespaces(client, tier, args)
    else:
        _ls_steps(client, tier, validate_namespace(args.namespace), args)


def _ls_namespaces(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    """Namespaces in memory and in the persistent tier. ``steps``/``committed_steps``/``bytes``
    count the memory tier; ``durable_steps`` the persistent tier (None: no persistent tier)."""
    docs: dict[str, dict[str, Any]] = {}
    for ns in [] if tier.offline else client.namespaces():
        docs[ns.namespace] = {**ns.model_dump(mode="json"), "tiers": ["memory"]}
    try:
        persisted = tier.namespaces()
        unreadable: Exception | None = None
    except (TierCkptError, OSError) as e:  # show what memory holds, then fail (exit 1)
        persisted, unreadable = {}, e
    for name, steps in persisted.items():
        doc = docs.setdefault(
            name,
            {
                "namespace": name,
                "steps": 0,
                "committed_steps": 0,
                "bytes": 0,
                "latest_committed": None,
                "tiers": [],
            },
        )
        doc["tiers"].append("persistent")
        doc["durable_steps"] = len(steps)
        doc["latest_committed"] = max(steps[-1], doc["latest_committed"] or -1)
    for doc in docs.values():
        doc.setdefault("durable_steps", 0 if tier.url and unreadable is None else None)
    ordered = [docs[k] for k in sorted(docs)]
    names = [d["namespace"] for d in ordered]
    r.emit(args.json, ordered, _namespaces_table(ordered), names=names)
    if unreadable is not None:
        raise TierCkptError(f"cannot list the persistent tier {tier.url}: {unreadable}")


def _ls_steps(client: DaemonClient, tier: Persistent, ns: str, args: argparse.Namespace) -> None:
    unreadable: Exception | None
    steps, candidates, silent, unreadable = (
        ([], {}, [], None) if tier.offline else _memory_steps(client, ns)
    )
    stored: list[int] = []
    if not tier.is_daemons:  # a store the daemon does not use: read it here
        try:
            stored = tier.steps(ns)
        except (TierCkptError, OSError) as e:  # show what memory holds, then fail, as `ls` does
            unreadable = e
        for step in stored:
            c = candidates.get(step)
            candidates[step] = StepCandidate(
                step=step,
                in_memory=c.in_memory if c else False,
                durable=True,
                peers=c.peers if c else [],
            )
    # A step may be committed and have a save attempt in progress too: one row each.
    docs: dict[tuple[int, str], dict[str, Any]] = {}
    for s in steps:
        doc = {**s.model_dump(mode="json"), "tiers": _tiers(s, candidates.get(s.step))}
        docs[(s.step, s.attempt or "")] = doc
    held = {step for step, _ in docs}
    for c in candidates.values():
        if c.step not in held and (c.durable or c.peers):
            docs[(c.step, "")] = _not_in_memory(ns, c)
    if silent:  # the listing may lack their copies
        r.warn(
            f"peers did not answer, their copies are not listed: {'; '.join(silent)} "
            "(tierckpt ls --cluster shows every node)"
        )
    if not docs and unreadable is not None:
        raise TierCkptError(f"cannot list the persistent tier {tier.url}: {unreadable}") from None
    if not docs:
        raise NotFoundError(f"namespace {ns!r} has no steps in memory" + _where(tier))
    now = time.time()
    ordered = [d for _, d in sorted(docs.items())]
    rows = [
        (
            d["step"],
            d["state"],
            "-" if d["bytes"] is None else r.size(d["bytes"]),
            len(d["files"]) if d["in_memory"] else "-",
            r.age(d["committed_at"] or d["created_at"], now),
            ",".join(d["tiers"]),
            _replicas_cell(d),
        )
        for d in ordered
    ]
    wide = [
        (
            r.opt(d["world_size"]),
            r.opt(d.get("owner")),
            r.age(d["created_at"], now),
            r.opt(d.get("attempt")),
        )
        for d in ordered
    ]
    text = r.table(
        ("STEP", "STATE", "SIZE", "FILES", "AGE", "TIERS", "REPLICAS"),
        rows,
        wide=(("WORLD", "OWNER", "CREATED", "ATTEMPT"), wide),
    )
    names = [f"{ns}/{d['step']}" for d in ordered if d["state"] != "writing"]
    notes = [] if r.OPTIONS.no_headers else attempts.ls_notes(ns, ordered)
    r.emit(args.json, ordered, "\n".join([text, *notes]), names=names)
    if unreadable is not None:
        raise TierCkptError(f"cannot list the persistent tier {tier.url}: {unreadable}") from None


def _memory_steps(
    client: DaemonClient, ns: str
) -> tuple[list[StepInfo], dict[int, StepCandidate], list[str], TierCkptError | None]:
    """The steps this node's daemon holds, the candidates it knows of in every tier, the peers
    that did not answer its listing, and why it could not list its persistent tier (then the
    memory tier's answer is shown, and the command fails after it, as ``ls`` does)."""
    try:
        steps = client.steps(ns)
    except NotFoundError:
        steps = []  # nothing in memory; the persistent tier may still hold steps
    try:
        found = client.listing(ns)
    except NotFoundError:
        return steps, {}, [], None
    except PersistentTierError as e:
        return steps, {}, [], e
    return steps, {c.step: c for c in found.candidates}, found.unanswered, None


def _ls_cluster(client: DaemonClient, args: argparse.Namespace) -> None:
    """Every node's steps in memory, as the daemon and its peers answered within the timeout; a
    node that did not answer is listed as unreachable (and the command still succeeds)."""
    ns = validate_namespace(args.namespace) if args.namespace is not None else None
    listing = client.cluster(ns, timeout_s=args.timeout)
    now = time.time()
    rows: list[tuple[object, ...]] = []
    notes: list[str] = []
    for node in listing.nodes:
        if not node.reachable:
            rows.append((node.node, "-", "-", "UNREACHABLE", "-", "-", "-", "-"))
            notes.append(f"{node.node} is unreachable: {node.error}")
        elif not node.steps:
            rows.append((node.node, "-", "-", "no steps", "-", "-", "-", "-"))
        for s in node.steps:
            rows.append(
                (
                    node.node,
                    s.namespace,
                    s.step,
                    s.state.value,
                    r.size(s.bytes),
                    s.files,
                    r.age(s.committed_at, now),
                    _replicas_cell(s.model_dump(mode="json")),
                )
            )
    text = r.table(("NODE", "NAMESPACE", "STEP", "STATE", "SIZE", "FILES", "AGE", "REPLICAS"), rows)
    if listing.node is None:
        notes.append("this daemon has no peers (TIERCKPT_PEERS): only this node is listed")
    names = [f"{node.node}/{s.namespace}/{s.step}" for node in listing.nodes for s in node.steps]
    r.emit(args.json, listing.model_dump(mode="json"), "\n".join([text, *notes]), names=names)


def _where(tier: Persistent) -> str:
    return f" or in {tier.url}" if tier.url else " (no persistent tier is configured)"


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


def _manifest_doc(m: StepManifest) -> dict[str, Any]:
    """A step only the persistent tier holds, in the shape of a StepInfo document."""
    return {
        "namespace": m.namespace,
        "step": m.step,
        "state": StepState.DURABLE.value,
        "bytes": sum(f.length for f in m.files),
        "files": [
            {
                "name": f.name,
                "rank": f.rank,
                "size": f.length,
                "length": f.length,
                "checksum": f.checksum,
            }
            for f in m.files
        ],
        "created_at": None,
        "committed_at": m.committed_at,
        "world_size": m.world_size,
        "persist": None,
        "in_memory": False,
        "replicated_to": [],
        "replication_pending": False,
        "origin": None,
        "tiers": ["persistent"],
    }


def cmd_inspect(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    ns, step = validate_namespace(args.namespace), validate_step(args.step)
    try:
        if tier.offline:
            raise StepNotFoundError(f"{ns}/step {step}: no daemon")
        info = client.step(ns, step)
    except NotFoundError:
        pending = [] if tier.offline else _attempts(client, ns, step)
        manifest = tier.manifest(ns, step)
        if manifest is None and pending:  # only a save in progress, or one left by a dead trainer
            writing: dict[str, Any] = {"namespace": ns, "step": step, "state": "writing"}
            writing["attempts"] = [a.model_dump(mode="json") for a in pending]
            r.emit(args.json, writing, attempts.attempts_text(ns, step, pending))
            return
        if manifest is None:
            raise StepNotFoundError(f"{ns}/step {step} is not in memory{_where(tier)}") from None
        doc = _manifest_doc(manifest)
    else:
        durable = info.state == StepState.DURABLE
        if not durable and tier.url is not None and not tier.is_daemons:
            durable = tier.manifest(ns, step) is not None
        doc = {**info.model_dump(mode="json")}
        tiers = ["memory"] + (["peers"] if info.replicated_to else [])
        doc["tiers"] = tiers + (["persistent"] if durable else [])
        pending = _attempts(client, ns, step)
    doc["attempts"] = [a.model_dump(mode="json") for a in pending]
    text = _step_text(doc)
    if pending:
        text += "\n\n" + attempts.attempts_text(ns, step, pending)
    r.emit(args.json, doc, text, names=[f"{ns}/{step}"])


def _attempts(client: DaemonClient, ns: str, step: int) -> list[AttemptInfo]:
    try:
        return client.attempts(ns, step)
    except NotFoundError:  # the namespace is not on this node
        return []


def _step_text(d: dict[str, Any]) -> str:
    now = time.time()
    lines = [
        f"namespace   {d['namespace']}",
        f"step        {d['step']}",
        f"state       {d['state']}",
        f"tiers       {', '.join(d['tiers'])}",
        f"world size  {r.opt(d['world_size'])}",
        f"size        {r.size(d['bytes'])} in {len(d['files'])} file(s)",
        f"created     {r.age(d['created_at'], now) + ' ago' if d['created_at'] else '-'}",
        f"committed   {r.age(d['committed_at'], now) + ' ago' if d['committed_at'] else '-'}",
        f"replicas    {_replicas_cell(d)}",
        "",
    ]
    rows = [
        (f["rank"], f["name"], r.size(f["size"]), f["length"], f.get("checksum") or "-")
        for f in sorted(d["files"], key=lambda f: (f["rank"], f["name"]))
    ]
    lines.append(r.table(("RANK", "FILE", "SIZE", "LENGTH", "CHECKSUM"), rows))
    return "\n".join(lines)
