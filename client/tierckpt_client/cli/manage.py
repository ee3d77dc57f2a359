"""``rm``, ``persist``, ``prefetch`` and ``export``: commands that move or remove a step."""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path

from tierckpt_client.cli import _render as r
from tierckpt_client.cli._tiers import Persistent
from tierckpt_client.cli.attempts import remove_abandoned
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import (
    CheckpointFormatError,
    InvalidNameError,
    NotFoundError,
    StepNotFoundError,
    TierCkptError,
)
from tierckpt_core.protocol import StepInfo, StepState, validate_namespace, validate_step


class MissingExtraError(TierCkptError):
    """A command needs an optional dependency that is not installed."""


def cmd_rm(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    ns, step = validate_namespace(args.namespace), validate_step(args.step)
    if args.abandoned:
        freed, size = remove_abandoned(client, ns, step)
        doc = {"namespace": ns, "step": step, "removed": ["memory"], "attempts": freed}
        text = (
            f"freed {r.size(size)} of {ns} step {step}'s abandoned save attempt {', '.join(freed)}"
        )
        r.done(args.json, doc, text)
        return
    if not args.persistent:
        try:
            client.delete(ns, step)
        except NotFoundError as e:
            raise _with_hint(client, tier, ns, step, e) from None
        r.done(
            args.json,
            {"namespace": ns, "step": step, "removed": ["memory"]},
            f"removed {ns} step {step}",
        )
        return
    if not args.yes:
        raise InvalidNameError(
            f"removing {ns} step {step} from the persistent tier cannot be undone; "
            "add --yes to confirm"
        )
    if tier.url is None:
        raise TierCkptError("no persistent tier is configured (TIERCKPT_PERSIST_URL is not set)")
    removed = []
    try:
        client.delete(ns, step)  # first: the daemon must not keep calling a deleted step durable
        removed.append("memory")
    except NotFoundError:
        pass
    if tier.remove(ns, step):
        removed.append("persistent")
    if not removed:
        raise StepNotFoundError(f"{ns}/step {step} is neither in memory nor in {tier.url}")
    doc = {"namespace": ns, "step": step, "removed": removed}
    r.done(args.json, doc, f"removed {ns} step {step} from {' and '.join(removed)}")


def _with_hint(
    client: DaemonClient, tier: Persistent, ns: str, step: int, e: NotFoundError
) -> NotFoundError:
    """A step ``rm`` found nothing committed of in memory: say what it could do instead."""
    try:
        pending = [a for a in client.attempts(ns, step) if not a.prepared]
    except NotFoundError:
        pending = []
    if pending:
        e.message = (
            f"{ns}/step {step} is not committed in memory; it has a save attempt that is not "
            f"committed ({', '.join(a.attempt for a in pending)}): tierckpt rm {ns} {step} "
            "--abandoned frees it once its writer is gone"
        )
    elif tier.url is not None and tier.manifest(ns, step) is not None:
        e.message = (
            f"{ns}/step {step} is not in memory; the persistent tier {tier.url} holds it: "
            f"tierckpt rm {ns} {step} --persistent --yes deletes it there (cannot be undone)"
        )
    e.args = (e.message,)
    return e


def cmd_export(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    try:
        from tierckpt_client.dcp.export import export_step  # needs torch, the others do not
    except ModuleNotFoundError as e:
        raise MissingExtraError(
            f"tierckpt export needs {e.name or 'torch'}, which is not installed: "
            "pip install 'tierckpt[client]'"
        ) from None
    ns = validate_namespace(args.namespace)
    step = None if args.step == "latest" else validate_step(parse_step(args.step))
    dest = Path(args.dest)
    created = not dest.exists()
    try:
        written = export_step(ns, step, dest, config=client.config)
    except BaseException:
        if created:  # a failed export leaves nothing behind that it made
            shutil.rmtree(dest, ignore_errors=True)
        raise
    doc = {"namespace": ns, "step": written, "path": str(args.dest)}
    r.done(
        args.json,
        doc,
        f"exported {ns} step {written} to {args.dest} (torch FileSystemReader format)",
    )


def cmd_persist(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    ns, step = validate_namespace(args.namespace), validate_step(args.step)
    info = client.persist(ns, step)
    if args.wait and info.state != StepState.DURABLE:
        info = _wait_durable(client, info, args.timeout)
    if info.state == StepState.DURABLE:
        text = f"{ns} step {step} is durable"
    else:
        text = f"{ns} step {step} queued for upload (tierckpt ls {ns} shows when it is durable)"
    r.done(args.json, info.model_dump(mode="json"), text)


def _wait_durable(client: DaemonClient, info: StepInfo, timeout_s: float) -> StepInfo:
    """Poll until the step is durable, with a bar of the bytes of its files uploaded so far (the
    daemon counts a file when its upload finished)."""
    ns, step = info.namespace, info.step
    total = sum(f.length for f in info.files)
    t0 = time.monotonic()
    error: str | None = None
    with r.byte_progress() as bar:
        task = bar.add_task(f"{ns} step {step}: queued", total=total)
        while True:
            info = client.step(ns, step)
            elapsed = time.monotonic() - t0
            if info.state == StepState.DURABLE:
                bar.update(task, completed=total, description=f"{ns} step {step}: durable")
                break
            p = client.status().persistent
            error = p.last_error if p is not None else None
            # The decider of a step spanning nodes waits for the other nodes' shares: not an
            # error of its own (the other nodes' statuses say theirs), and not a queue either.
            shares = [w for w in (p.waiting if p else []) if w.startswith(f"{ns}/step {step}:")]
            error = shares[0] if shares else error
            done = [u for u in (p.uploads if p else []) if (u.namespace, u.step) == (ns, step)]
            if done:
                bar.update(
                    task, completed=done[0].done_bytes, description=f"{ns} step {step}: uploading"
                )
            if elapsed > timeout_s:
                why = f": {error}" if error else " (still queued behind other uploads)"
                raise TierCkptError(f"{ns} step {step} is not durable after {timeout_s:.0f}s{why}")
            time.sleep(0.2)
    rate = total / elapsed / 1e6 if elapsed > 0 else 0.0
    r.note(f"{ns} step {step}: durable after {elapsed:.1f}s ({r.size(total)}, {rate:.0f} MB/s)")
    return info


def cmd_prefetch(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    ns = validate_namespace(args.namespace)
    if args.step != "latest":
        _prefetch(client, ns, validate_step(parse_step(args.step)), args)
        return
    # What a restore's "latest" would pick: the newest that verifies, a corrupt one skipped.
    candidates = [c.step for c in client.candidates(ns, complete=True)]
    if not candidates:
        raise StepNotFoundError(f"namespace {ns} has no committed step")
    for i, step in enumerate(candidates):
        try:
            _prefetch(client, ns, step, args)
            return
        except (CheckpointFormatError, NotFoundError) as e:
            if i + 1 == len(candidates):
                raise
            r.warn(f"{ns}: skipping step {step} for an older one: {e}")


def _prefetch(client: DaemonClient, ns: str, step: int, args: argparse.Namespace) -> None:
    """Bring ``ns``/``step`` into memory, with a progress bar from the daemon's status."""
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
    r.note(f"prefetch {ns} step {step}: starting")
    t0 = time.monotonic()
    held = _in_memory(client, ns, step)  # before the hydration starts: it may end at once
    worker.start()
    if held:  # answered at once (unless files of it are still to come): no bar for it
        worker.join(QUIET_S)
    if not held or worker.is_alive():
        _progress(client, worker, ns, step, result)
    if failure:
        raise failure[0]
    info = result[0]
    total = sum(f.length for f in info.files)
    r.note(
        f"prefetch {ns} step {step}: {r.size(total)} in memory after {time.monotonic() - t0:.1f}s"
    )
    text = f"{ns} step {step} is in memory ({info.state.value}, {r.size(info.bytes)})"
    r.done(args.json, info.model_dump(mode="json"), text)


QUIET_S = 0.5
"""How long a prefetch of a step already in memory goes without a progress bar."""


def _in_memory(client: DaemonClient, ns: str, step: int) -> bool:
    """Whether this node's memory holds ``ns``/``step`` committed already (False if the daemon
    does not say: the prefetch's own answer tells)."""
    try:
        return any(s.step == step and s.state != StepState.WRITING for s in client.steps(ns))
    except TierCkptError:
        return False


def _progress(
    client: DaemonClient,
    worker: threading.Thread,
    ns: str,
    step: int,
    result: list[StepInfo],
) -> None:
    """A progress bar of ``worker``'s prefetch, from the daemon's status, until it ends."""
    with r.byte_progress() as bar:
        task = bar.add_task(f"prefetch {ns} step {step}", total=None)
        while worker.is_alive():
            worker.join(0.2)
            try:
                p = client.status().persistent
            except TierCkptError:
                continue  # a slow status answer must not end the prefetch
            for h in p.hydrations if p is not None else []:
                if (h.namespace, h.step) == (ns, step):
                    bar.update(task, completed=h.done_bytes, total=h.total_bytes)
        if result:
            total = sum(f.length for f in result[0].files)
            bar.update(task, completed=total, total=total)


def parse_step(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidNameError(f"step must be a number or 'latest', got {text!r}") from None
