"""Deadlines around blocking calls that have no timeout of their own (the CRT S3 client).

The CRT client that s3torchconnector wraps has no per-request timeout: against a server that
accepts connections and then stops answering (a stopped process, a black-holed route) a write,
a read or the completion of an upload blocks forever, and nothing in the binding can cancel it.
So the work runs in a helper thread that reports progress (:meth:`Deadline.extend` before each
blocking step, with what that step may take), and the caller waits only while the current step is
within its allowance. On expiry the caller raises :class:`Expired` and moves on; the helper is
abandoned: the next time it gets control back (when the server answers or the connection dies) it
raises :class:`Abandoned` instead of doing more, so an abandoned upload is never completed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

_T = TypeVar("_T")


class Abandoned(Exception):
    """Raised in a helper thread whose caller gave up on it."""


class Expired(Exception):
    """A step of the work made no progress within its allowance."""

    def __init__(self, step: str, allowed_s: float) -> None:
        super().__init__(step, allowed_s)
        self.step = step
        self.allowed_s = allowed_s

    def __str__(self) -> str:
        return f"{self.step} did not finish within {self.allowed_s:.1f}s"


class Deadline:
    """The allowance of the step a helper thread is in; shared with the waiting caller."""

    def __init__(self, step: str, allowed_s: float) -> None:
        self._lock = threading.Lock()
        self._step = step
        self._allowed = allowed_s
        self._expires = time.monotonic() + allowed_s
        self.abandoned = False
        self._finished = False

    def extend(self, step: str, allowed_s: float) -> None:
        """Start the next blocking step, which may take ``allowed_s`` seconds; raise
        :class:`Abandoned` if the caller already gave up."""
        with self._lock:
            if self.abandoned:
                raise Abandoned(step)
            self._step = step
            self._allowed = allowed_s
            self._expires = time.monotonic() + allowed_s

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Run a short side effect (a write into the caller's buffer) only if the caller has not
        given up, and hold off its giving up until the side effect is done."""
        with self._lock:
            if self.abandoned:
                raise Abandoned(self._step)
            yield

    def _finish(self) -> bool:
        """The helper is done; return whether it had been abandoned first."""
        with self._lock:
            self._finished = True
            return self.abandoned

    def _expire_if_due(self) -> Expired | None:
        with self._lock:
            if self._finished or time.monotonic() < self._expires:
                return None
            self.abandoned = True
            return Expired(self._step, self._allowed)

    def _left(self) -> float:
        with self._lock:
            return self._expires - time.monotonic()


class _Outcome(Generic[_T]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: _T | None = None
        self.error: BaseException | None = None


def run_with_deadline(
    fn: Callable[[Deadline], _T],
    step: str,
    allowed_s: float,
    *,
    name: str = "tierckpt-bounded",
    on_exit: Callable[[bool], None] | None = None,
) -> _T:
    """Run ``fn(deadline)`` in a new daemon thread and return its result or raise its error;
    raise :class:`Expired` as soon as its current step overruns its allowance.

    ``on_exit(abandoned)`` runs in the helper thread when ``fn`` finally returns or raises (for
    accounting of helpers still blocked after their caller left).
    """
    deadline = Deadline(step, allowed_s)
    out: _Outcome[_T] = _Outcome()

    def body() -> None:
        try:
            out.value = fn(deadline)
        except BaseException as e:  # handed to the caller, who re-raises it
            out.error = e
        finally:
            abandoned = deadline._finish()
            out.done.set()
            if on_exit is not None:
                on_exit(abandoned)

    threading.Thread(target=body, name=name, daemon=True).start()
    while not out.done.wait(max(deadline._left(), 0.0)):
        expired = deadline._expire_if_due()
        if expired is not None:
            raise expired
    if out.error is not None:
        raise out.error
    return out.value  # type: ignore[return-value]
