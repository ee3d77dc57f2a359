"""``tierckpt://<namespace>/<step>``: the ``checkpoint_id`` a tierckpt writer or reader takes.

Public: the framework integrations (``integrations/``), the SageMaker compatibility module and
``dcp.reader``/``dcp.writer`` all name steps this way. ``tierckpt://<namespace>`` (no step) names
the newest committed step, for a load.
"""

from __future__ import annotations

import os

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
