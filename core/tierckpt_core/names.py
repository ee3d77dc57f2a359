"""Names that end up in paths (namespaces, file names, steps, ranks) and their bounds, checked on
both sides of every API and wherever a name is read back from storage."""

from __future__ import annotations

import re

from tierckpt_core.errors import InvalidNameError

MAX_NAME_LEN = 128
MAX_STEP = 10**12 - 1  # steps are laid out as step_{N:012d}
MAX_RANK = 1 << 20
MAX_FILE_BYTES = 1 << 44  # 16 TiB: a sanity bound, the capacity is the real one

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _validate_name(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidNameError(f"{kind} must be a string, got {type(value).__name__}")
    if not value or len(value) > MAX_NAME_LEN:
        raise InvalidNameError(f"{kind} {value!r} must be 1 to {MAX_NAME_LEN} characters long")
    if not _NAME_RE.fullmatch(value) or ".." in value:
        raise InvalidNameError(
            f"{kind} {value!r} may only contain letters, digits, '.', '_' and '-', must start "
            "with a letter or digit and must not contain '..'"
        )
    return value


def validate_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is a valid namespace, else raise :class:`InvalidNameError`."""
    return _validate_name("namespace", namespace)


def validate_file_name(name: object) -> str:
    """Return ``name`` if it is a valid shard file name, else raise :class:`InvalidNameError`."""
    return _validate_name("file name", name)


def validate_attempt(attempt: object) -> str:
    """Return ``attempt`` if it is a valid save-attempt id (it ends up in URLs), else raise."""
    return _validate_name("attempt", attempt)


def validate_step(step: object) -> int:
    """Return ``step`` as an int if it is a valid step number, else raise :class:`InvalidNameError`."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidNameError(f"step must be an integer, got {step!r}")
    if not 0 <= step <= MAX_STEP:
        raise InvalidNameError(f"step {step} is out of range 0..{MAX_STEP}")
    return step


def validate_rank(rank: object) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
        raise InvalidNameError(f"rank must be an integer in 0..{MAX_RANK - 1}, got {rank!r}")
    return rank
