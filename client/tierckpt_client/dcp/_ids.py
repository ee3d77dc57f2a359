"""``tierckpt://<namespace>/<step>`` checkpoint ids."""

from __future__ import annotations

import os
import uuid

from tierckpt_core.errors import InvalidNameError
from tierckpt_core.protocol import validate_namespace, validate_step

SCHEME = "tierckpt://"


def format_checkpoint_id(namespace: str, step: int | None) -> str:
    return f"{SCHEME}{namespace}" + ("" if step is None else f"/{step}")


def parse_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> tuple[str, int | None]:
    """Split ``tierckpt://ns/step`` (or ``tierckpt://ns`` for "latest") into its parts."""
    text = os.fspath(checkpoint_id)
    if not text.startswith(SCHEME):
        raise InvalidNameError(
            f"checkpoint_id {text!r} is not a tierckpt id; expected tierckpt://<namespace>/<step>"
        )
    rest = text[len(SCHEME) :].rstrip("/")
    namespace, _, step_text = rest.partition("/")
    validate_namespace(namespace)
    if not step_text:
        return namespace, None
    if not step_text.isdigit():
        raise InvalidNameError(f"checkpoint_id {text!r}: step {step_text!r} is not a number")
    return namespace, validate_step(int(step_text))


def is_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> bool:
    try:
        parse_checkpoint_id(checkpoint_id)
    except (InvalidNameError, TypeError):
        return False
    return True


# Save attempt ids. Every rank of one save must seal under the same attempt id, and two saves of
# one step must not share one (the daemon would mix their files). The coordinator cannot hand a
# fresh id to the ranks through the plan: with DefaultSavePlanner(enable_plan_caching=True), DCP
# gives every rank its cached plan from an earlier save, storage data included. So the plan carries
# a base that stays the same for as long as the coordinator's process lives, and every rank derives
# the attempt from it and the number of saves of this step it has written with that base: the
# same on every rank, whichever plan (fresh or cached) it got.
_base: str | None = None
_saves: dict[tuple[str, str, int], int] = {}


def attempt_base() -> str:
    """The coordinator process's attempt base (random, made once per process)."""
    global _base
    if _base is None:
        _base = uuid.uuid4().hex[:16]
    return _base


def next_attempt(base: str, namespace: str, step: int) -> str:
    """The attempt id of this rank's next save of ``namespace``/``step`` under ``base``."""
    key = (base, namespace, step)
    _saves[key] = _saves.get(key, 0) + 1
    return f"{base}.{_saves[key]}"
