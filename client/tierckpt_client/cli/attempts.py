"""Save attempts that are not committed: a save in progress, or one a trainer left when it died
mid-save. ``ls`` says when the daemon reclaims them, ``inspect`` shows them (owner, age, writer,
when they go), ``rm --abandoned`` frees them now (the daemon refuses while a writer runs)."""

from __future__ import annotations

import time
from typing import Any

from tierckpt_client.cli import _render as r
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import StepNotFoundError
from tierckpt_core.protocol import AttemptInfo


def writer_cell(alive: bool | None, writers: list[int] | None = None) -> str:
    pids = f" (pid {', '.join(map(str, writers))})" if writers else ""
    return {True: "running", False: "gone", None: "unknown"}[alive] + pids


def reclaim_cell(reclaim_in_s: float | None) -> str:
    if reclaim_in_s is None:
        return "by its decider"
    return "in " + r.age(time.time() - reclaim_in_s, time.time())


def ls_notes(ns: str, docs: list[dict[str, Any]]) -> list[str]:
    """One line per uncommitted attempt in an ``ls NS`` listing: when it goes, how to free it."""
    notes = []
    for d in docs:
        if d.get("state") != "writing" or d.get("attempt") is None:
            continue
        what = f"step {d['step']}: save attempt {d['attempt']} is not committed"
        if d.get("writer_alive") is False:
            notes.append(
                f"{what} and its writer is gone; the daemon reclaims it "
                f"{reclaim_cell(d.get('reclaim_in_s'))} (tierckpt rm {ns} {d['step']} "
                "--abandoned frees it now)"
            )
        else:
            notes.append(
                f"{what} (writer {writer_cell(d.get('writer_alive'))}); if it stalls the daemon "
                f"reclaims it {reclaim_cell(d.get('reclaim_in_s'))}"
            )
    return notes


def attempts_table(attempts: list[AttemptInfo]) -> str:
    now = time.time()
    rows = [
        (
            a.attempt,
            "prepared" if a.prepared else "writing",
            r.size(a.bytes),
            len(a.files),
            r.opt(a.owner),
            r.age(a.created_at, now),
            r.age(now - a.idle_s, now),
            writer_cell(a.writer_alive, a.writers),
            reclaim_cell(a.reclaim_in_s),
        )
        for a in attempts
    ]
    return r.table(
        ("ATTEMPT", "STATE", "SIZE", "FILES", "OWNER", "AGE", "IDLE", "WRITER", "RECLAIMED"),
        rows,
    )


def attempts_text(ns: str, step: int, attempts: list[AttemptInfo]) -> str:
    lines = [f"save attempts of {ns} step {step} not committed:", attempts_table(attempts)]
    if any(a.writer_alive is not True and not a.prepared for a in attempts):
        lines.append(
            f"(tierckpt rm {ns} {step} --abandoned frees an attempt whose writer is gone; "
            "the daemon refuses while it runs)"
        )
    return "\n".join(lines)


def remove_abandoned(client: DaemonClient, ns: str, step: int) -> tuple[list[str], int]:
    """Free every attempt of the step that is not prepared for a commit across nodes (the
    daemon refuses one whose writer runs). Returns the attempts freed and their bytes."""
    attempts = [a for a in client.attempts(ns, step) if not a.prepared]
    if not attempts:
        raise StepNotFoundError(
            f"{ns}/step {step} has no save attempt in progress on this node that could be "
            "freed (an attempt prepared for a commit across nodes is ended by its decider)"
        )
    for a in attempts:
        client.abort(ns, step, a.attempt, abandoned=True)
    return [a.attempt for a in attempts], sum(a.bytes for a in attempts)
