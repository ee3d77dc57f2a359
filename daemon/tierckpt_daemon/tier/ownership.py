"""Which identity a namespace belongs to on this node, and the checks that keep tenants apart.

A namespace belongs to the identity (``uid:<n>``, see :mod:`tierckpt_daemon.tier.tenants`) that first
saved into it here; its steps record that owner (``StepRecord.owner``, the manifest's ``owner``),
which travels with every replica and every copy a peer serves. :class:`~tierckpt_daemon.tier.service.
TierService` inherits these methods; each takes the service's lock.

The rules: a local caller reaches a namespace only if it owns it, or it has no owner here yet (the
first save claims it), or the caller is an administrator (:attr:`Caller.admin`); a copy from
elsewhere (a replica, a restore) of another owner's step is refused, and a copy never replaces a
step this node's own trainers committed.
"""

from __future__ import annotations

import threading

from tierckpt_core.errors import NamespaceOwnerError
from tierckpt_core.protocol import validate_namespace
from tierckpt_daemon.tier.index import StepIndex
from tierckpt_daemon.tier.records import StepRecord, committed_here


def owned_by(step_owner: str | None, owner: str | None) -> bool:
    """Whether a step whose namespace belongs to ``step_owner`` counts for ``owner`` (None: no
    one in particular, an administrator's view). A step saved by a daemon from before owners
    (None) is anyone's."""
    return owner is None or step_owner is None or step_owner == owner


def refuse(namespace: str, owner: str, caller: str) -> NamespaceOwnerError:
    return NamespaceOwnerError(
        f"namespace {namespace} belongs to {owner} on this node, not to the caller ({caller}); "
        "a trainer reaches only the namespaces its own user saved (docs/security.md, "
        '"Tenants and namespace ownership"): use another namespace, or run as that user'
    )


class Ownership:
    lock: threading.RLock
    index: StepIndex

    def owner_of(self, namespace: str) -> str | None:
        with self.lock:
            return self.index.owner_of(namespace)

    def authorize(self, namespace: str, identity: str, *, admin: bool = False) -> None:
        """Refuse ``identity`` any access to a namespace another identity owns here."""
        validate_namespace(namespace)
        owner = self.owner_of(namespace)
        if owner is not None and owner != identity and not admin:
            raise refuse(namespace, owner, identity)

    def acting_owner(self, namespace: str, identity: str, *, admin: bool = False) -> str | None:
        """Whose steps a read by ``identity`` may see, here and on peers: its own; an
        administrator's, the namespace's owner here (None: anyone's)."""
        return self.owner_of(namespace) if admin else identity

    def claim(self, namespace: str, identity: str | None, *, admin: bool = False) -> str | None:
        """The owner a save by ``identity`` records: the namespace's owner here, or, if it has
        none yet, ``identity`` (None: a copy from before owners, anyone's)."""
        with self.lock:
            current = self.index.owner_of(namespace)
            if current is None or identity is None or current == identity or admin:
                return current or identity
            raise refuse(namespace, current, identity)

    def refuse_copy(
        self,
        namespace: str,
        step: int,
        attempt: str,
        owner: str | None,
        *,
        besides: StepRecord | None = None,
    ) -> None:
        """Raise NamespaceOwnerError for a copy of ``namespace/step`` from elsewhere (a replica,
        a restore; ``besides``: its own record here) that would land in a namespace another
        identity owns here, or replace a save of this node's own trainers."""
        with self.lock:
            current = self.index.owner_of(namespace, besides=besides)
            if current is not None and owner is not None and owner != current:
                raise NamespaceOwnerError(
                    f"a copy of {namespace}/step {step} owned by {owner} is refused: the "
                    f"namespace belongs to {current} on this node"
                )
            here = self.index.committed.get(namespace, {}).get(step)
            if here is not None and committed_here(here) and here.attempt != attempt:
                raise NamespaceOwnerError(
                    f"{namespace}/step {step} was committed by this node's own trainers (attempt "
                    f"{here.attempt}); a copy from elsewhere (attempt {attempt}) never replaces it"
                )
