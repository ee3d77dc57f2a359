"""A run that finds no step of its namespace starts fresh: said at INFO, or as a WARNING naming
the namespaces this node's daemon holds under a similar name (a misspelt namespace on a resume
otherwise starts training again from scratch, and reads like a first run)."""

from __future__ import annotations

import difflib
import logging

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import TierCkptError

# difflib's ratio: "my-job" against "my-jbo" 0.83, "llama-run" against "lama-run" 0.94;
# "job-a" against "train-b" 0.33.
SIMILAR = 0.75


def similar_namespaces(namespace: str, config: ClientConfig | None = None) -> list[str]:
    """The namespaces with committed steps on this node's daemon (those this caller may reach)
    whose names are close to ``namespace``'s; none when the daemon cannot be asked."""
    try:
        with DaemonClient(config) as client:
            held = [n.namespace for n in client.namespaces() if n.committed_steps]
    except TierCkptError:
        return []  # the fresh start is said anyway; a daemon that is down fails the first save
    others = [n for n in held if n != namespace]
    return difflib.get_close_matches(namespace, others, n=3, cutoff=SIMILAR)


def starting_fresh(
    log: logging.Logger,
    namespace: str,
    reason: object,
    config: ClientConfig | None = None,
    *,
    what: str = "no step to restore, starting fresh",
) -> None:
    """Log that ``namespace`` has no step to resume from (``reason``: the daemon's answer)."""
    similar = similar_namespaces(namespace, config)
    if not similar:
        log.info("%s: %s (%s)", namespace, what, reason)
        return
    names = ", ".join(repr(n) for n in similar)
    log.warning(
        "%s: %s (%s); this node's daemon holds steps of %s: if this run should resume one of "
        "them, its namespace is misspelt",
        namespace,
        what,
        reason,
        names,
    )
