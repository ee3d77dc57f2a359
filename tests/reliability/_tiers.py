"""Checks of what the tiers hold, shared by the reliability tests: every step a daemon or the
persistent tier lists as committed or durable has all its files with the bytes its manifest's
checksums name; what a crash left in a tier directory; whether dead saves were reclaimed."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from tierckpt_client import DaemonClient
from tierckpt_core.errors import NotFoundError, StepNotFoundError, TierCkptError
from tierckpt_core.integrity import checksum_file
from tierckpt_core.layout import durable_steps, file_key, read_step_manifest
from tierckpt_core.objectstore import open_store

from helpers import DaemonProcess

MANIFEST = "MANIFEST.json"
PREPARED = "MANIFEST.prepared.json"


def memory_problems(d: DaemonProcess, namespace: str) -> list[str]:
    """Steps ``d`` lists as committed or durable whose files (its own share) are missing, short,
    or differ from their checksums. A step that leaves memory while it is checked is skipped."""
    problems = []
    with DaemonClient.from_socket(d.socket) as c:
        try:
            steps = c.steps(namespace)
        except NotFoundError:
            return []
        for info in steps:
            if info.state.value == "writing":
                continue
            try:
                pin = c.pin(namespace, info.step)
            except NotFoundError:
                continue  # evicted (retention after a replica's commit) since the listing
            try:
                for f in pin.step.files:
                    if f.node is not None and f.node != d.name:
                        continue  # another node's share of a step spanning nodes
                    where = f"{d.name or d.shm_dir} {namespace}/step {info.step} file {f.name}"
                    path = pin.paths.get(f.name)
                    if path is None or not os.path.isfile(path):
                        problems.append(f"{where}: listed {info.state.value}, file missing")
                    elif os.path.getsize(path) < f.length:
                        problems.append(f"{where}: {os.path.getsize(path)} < {f.length} bytes")
                    elif f.checksum is None:
                        problems.append(f"{where}: committed without a checksum")
                    elif checksum_file(path, f.length) != f.checksum:
                        problems.append(f"{where}: bytes differ from the checksum")
            finally:
                with contextlib.suppress(TierCkptError):
                    c.unpin(namespace, info.step, pin.pin_id)
    return problems


def durable_problems(url: str, namespace: str) -> tuple[int, list[str]]:
    """How many steps of ``namespace`` the file:// persistent tier at ``url`` holds durable, and
    those whose manifest or files are missing or differ from their checksums."""
    root = Path(url.removeprefix("file://"))
    problems = []
    store = open_store(url)
    try:
        steps = durable_steps(store, namespace)
        for step in steps:
            try:
                manifest = read_step_manifest(store, namespace, step)
            except StepNotFoundError:
                continue  # deleted by persist_keep_last since the listing
            except (TierCkptError, OSError) as e:
                problems.append(f"durable {namespace}/step {step}: {e}")
                continue
            for f in manifest.files:
                path = root / file_key(namespace, step, f.name)
                try:
                    ok = checksum_file(str(path), f.length) == f.checksum
                except OSError as e:
                    if not (root / file_key(namespace, step, "COMMITTED")).exists():
                        continue  # deleted (marker first) since the listing
                    problems.append(f"durable {namespace}/step {step} file {f.name}: {e}")
                    continue
                if not ok:
                    problems.append(f"durable {namespace}/step {step} file {f.name}: bytes differ")
    finally:
        store.close()
    return len(steps), problems


def phases(shm_dir: Path) -> set[str]:
    """What a tier directory shows was under way (read right after a kill): leased files being
    written, sealed attempts not committed, a commit across nodes prepared and undecided, steps
    waiting for their upload or their replica."""
    seen: set[str] = set()
    with contextlib.suppress(OSError):
        if os.listdir(shm_dir / "leases"):
            seen.add("stage/write (leased)")
    with contextlib.suppress(OSError):
        for ns in os.listdir(shm_dir / "ns"):
            for step_dir in os.listdir(shm_dir / "ns" / ns):
                path = shm_dir / "ns" / ns / step_dir
                names = set(os.listdir(path)) if path.is_dir() else set()
                if PREPARED in names:
                    seen.add("global commit (prepared)")
                elif MANIFEST not in names:
                    seen.add("sealed, not committed")
                else:
                    local = _local_state(path / MANIFEST)
                    if local.get("persist_pending"):
                        seen.add("upload pending")
                    if local.get("replication_pending"):
                        seen.add("replication pending")
    return seen or {"between saves"}


def _local_state(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    local = doc.get("local") if isinstance(doc, dict) else None
    return local if isinstance(local, dict) else {}


def leftovers(d: DaemonProcess) -> list[str]:
    """What of dead saves is still held by ``d``: leases, attempts being written or prepared,
    step directories without a commit record, and bytes the daemon counts that no file holds."""
    found = []
    status = d.status()
    if status is None:
        return [f"{d.shm_dir}: the daemon does not answer"]
    if status["leased_bytes"]:
        found.append(f"{status['leased_bytes']} bytes still leased")
    found += [f"leases/{n}" for n in sorted(os.listdir(d.shm_dir / "leases"))]
    on_disk = 0
    for sub in ("pool", "leases"):
        for n in os.listdir(d.shm_dir / sub):
            on_disk += os.lstat(d.shm_dir / sub / n).st_size
    with DaemonClient.from_socket(d.socket) as c:
        for ns in os.listdir(d.shm_dir / "ns"):
            with contextlib.suppress(NotFoundError):
                for info in c.steps(ns):
                    if info.state.value == "writing":
                        found.append(f"{ns}/step {info.step} still being written")
            for step_dir in os.listdir(d.shm_dir / "ns" / ns):
                path = d.shm_dir / "ns" / ns / step_dir
                names = os.listdir(path)
                if MANIFEST not in names or PREPARED in names:
                    found.append(f"ns/{ns}/{step_dir} without a commit record")
                for n in names:
                    if not n.startswith(MANIFEST):
                        on_disk += os.lstat(path / n).st_size
    if on_disk != status["used_bytes"]:
        found.append(
            f"the daemon counts {status['used_bytes']} bytes in use, its files hold {on_disk}"
        )
    return found
