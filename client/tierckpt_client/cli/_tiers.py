"""The persistent tier as the CLI sees it, read directly with :mod:`tierckpt_core.layout`.

The daemon reports only what its memory tier holds (and, per namespace, which steps are durable),
so a checkpoint that exists only in the persistent tier (after a node was replaced, or written by
another node) is found by listing the store itself. Its URL is ``TIERCKPT_PERSIST_URL`` when set
(an operator pointing the CLI at a store), else the one the daemon's status names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import NotFoundError
from tierckpt_core.layout import (
    MARKER,
    StepManifest,
    durable_steps,
    marker_key,
    parse_step_key,
    read_step_manifest,
    step_prefix,
)
from tierckpt_core.objectstore import ObjectStore, open_store

logger = logging.getLogger(__name__)


@dataclass
class Persistent:
    """The persistent tier of this node (or of ``TIERCKPT_PERSIST_URL``), opened on first use."""

    client: DaemonClient
    _store: ObjectStore | None = None
    _url: str | None = None
    _resolved: bool = False
    daemon_url: str | None = field(default=None, init=False)
    # No daemon answers: the commands that can (ls, inspect, verify, export) read the store of
    # TIERCKPT_PERSIST_URL alone (see main.DAEMONLESS).
    offline: bool = field(default=False, init=False)

    def go_offline(self) -> str | None:
        """Read ``TIERCKPT_PERSIST_URL`` alone, without the daemon; returns it."""
        self.offline, self._resolved = True, True
        self.daemon_url, self._url = None, self.client.config.persist_url
        return self._url

    @property
    def url(self) -> str | None:
        if not self._resolved:
            self._resolved = True
            status = self.client.status().persistent
            self.daemon_url = status.url if status is not None else None
            self._url = self.client.config.persist_url or self.daemon_url
        return self._url

    @property
    def store(self) -> ObjectStore | None:
        if self._store is None and self.url is not None:
            self._store = open_store(self.url)
        return self._store

    @property
    def is_daemons(self) -> bool:
        """Whether the daemon itself uses this store (then its candidates already cover it)."""
        return self.url is not None and self.url == self.daemon_url

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    # -- reads ---------------------------------------------------------------------------------
    def namespaces(self) -> dict[str, list[int]]:
        """Every namespace with at least one durable step -> its durable steps, oldest first."""
        store = self.store
        if store is None:
            return {}
        found: dict[str, set[int]] = {}
        for obj in store.list(""):
            ns, _, rest = obj.key.partition("/")
            parsed = parse_step_key(ns, obj.key) if rest else None
            if parsed is not None and parsed[1] == MARKER:
                found.setdefault(ns, set()).add(parsed[0])
        return {ns: sorted(steps) for ns, steps in sorted(found.items())}

    def steps(self, namespace: str) -> list[int]:
        return durable_steps(self.store, namespace) if self.store is not None else []

    def manifest(self, namespace: str, step: int) -> StepManifest | None:
        """The verified manifest of a durable step, or None if the tier does not hold it."""
        if self.store is None:
            return None
        try:
            return read_step_manifest(self.store, namespace, step)
        except NotFoundError:
            return None

    def remove(self, namespace: str, step: int) -> int:
        """Delete a step: its commit marker first (from then on it is not durable, so no reader
        takes a half-deleted step), then its files and manifest. Returns the objects deleted."""
        assert self.store is not None
        keys = [o.key for o in self.store.list(step_prefix(namespace, step))]
        if not keys:
            return 0
        marker = marker_key(namespace, step)
        self.store.delete([marker])
        self.store.delete([k for k in keys if k != marker])
        logger.info("removed %s/step %d from %s (%d objects)", namespace, step, self.url, len(keys))
        return len(keys)
