"""Pre-leases: the next save's file, asked for while this save commits, claimed without a round trip.

The lease round trip to the daemon is the one fixed cost in ``stage`` besides the copy (an HTTP
call answered by another process: milliseconds, tens of them on a loaded machine). So after a
rank has sealed its staged file (``write_data``, in ``async_save``'s background thread) it asks
its daemon for a file of the same size for its next save, granted when this save attempt commits
(from the file the commit frees under retention; see the daemon's ``leases`` module), on a thread
of its own, so the save's commit does not wait for that round trip. The answer names the file;
this module keeps it per (daemon socket, namespace, rank), in this process only, and the next
``stage`` of that key waits for an answer still on its way.

The next ``stage`` of that rank claims it locally: it opens the path, takes ``flock(LOCK_EX |
LOCK_NB)`` on it and checks that the path still names the file it locked. A file that is not
there (the commit freed none, the daemon took it back under memory pressure or restarted), a lock
the daemon holds (it is taking the file back right now), a size that no longer matches the state,
or a pre-lease about to expire: the save leases as before. Once claimed, the daemon leaves the
file alone until the lock is released, which happens when the file is sealed or given back, or
when the process dies.

PROCESS-mode ``async_save`` writes the save in DCP's helper process, so the pre-lease is asked for
there and must reach the trainer: the trainer hands the helper a mailbox (``_mailbox``) with the
pickled writer, and the helper writes the pre-lease into it as one line. The next ``stage`` reads
the mailbox (no round trip) before it claims.
"""

from __future__ import annotations

import concurrent.futures
import copy
import fcntl
import functools
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena, _mailbox
from tierckpt_client.dcp._mailbox import Mailbox
from tierckpt_client.dcp.targets.base import OutFile
from tierckpt_core.errors import TierCkptError

logger = logging.getLogger(__name__)

PAGE = 4096  # the daemon rounds lease sizes up to this
MARGIN_S = 5.0  # not claimed this close to the daemon's expiry
ASKED_WAIT_S = 5.0
"""How long a ``stage`` waits for its rank's pre-lease still being asked for (a save right after
the previous one committed); past it, the save leases as before."""


@dataclass(frozen=True)
class PreLease:
    lease_id: str
    path: str
    size: int
    deadline: float  # time.monotonic() after which the daemon may have taken it back


Key = tuple[str, str, int]  # (daemon socket, namespace, rank)

_lock = threading.Lock()
_held: dict[Key, PreLease] = {}
_boxes = _mailbox.Mailboxes()  # trainer side: where helper processes send pre-leases
# Pre-leases being asked for in this process, on a thread of their own (not on the way to the
# commit: :meth:`NextFile.ask`), by key; the next claim of that key waits for its answer.
_asking: dict[Key, concurrent.futures.Future[None]] = {}
_asker: concurrent.futures.ThreadPoolExecutor | None = None


def key(socket: str | Path, namespace: str, rank: int) -> Key:
    return (str(socket), namespace, rank)


def mailbox(k: Key) -> Mailbox:
    """Where a helper process sends this process the pre-lease for ``k``."""
    return _boxes.box(k)


def collect(k: Key) -> list[PreLease]:
    """Keep what a helper process sent for ``k`` (no round trip); returns the pre-leases that
    replaced, for the caller to give back off the stall."""
    replaced = []
    for line in _boxes.read(k, 1 << 16):
        try:
            lease_id, path, size, deadline = json.loads(line)
            pre = PreLease(str(lease_id), str(path), int(size), float(deadline))
        except (ValueError, TypeError):
            continue
        old = put(k, pre)
        if old is not None:
            replaced.append(old)
    return replaced


def send(box: Mailbox, pre: PreLease) -> bool:
    """Send ``pre`` to the process that made ``box``; whether it got there. The deadline is on
    ``time.monotonic``, which is the same clock in every process of the machine."""
    return _mailbox.send(box, [pre.lease_id, pre.path, pre.size, pre.deadline])


def put(k: Key, pre: PreLease) -> PreLease | None:
    """Keep ``pre`` for ``k``; return the one it replaces (for the caller to release)."""
    with _lock:
        old = _held.get(k)
        _held[k] = pre
        return old


def take(k: Key) -> PreLease | None:
    with _lock:
        return _held.pop(k, None)


def forget_all() -> None:
    """Drop every pre-lease this process knows of (the daemon takes them back by itself)."""
    with _lock:
        _held.clear()


def fits(pre: PreLease, size: int) -> bool:
    return pre.size == -(-size // PAGE) * PAGE


def claim(pre: PreLease, size: int) -> OutFile | None:
    """The pre-leased file, locked for this save, or None when it cannot be used (see above)."""
    if not fits(pre, size) or time.monotonic() > pre.deadline - MARGIN_S:
        return None
    try:
        fd = os.open(pre.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # not granted, taken back, or not a regular file
        return None
    claimed = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # the daemon is taking it back
            return None
        st = os.fstat(fd)
        try:
            at = os.lstat(pre.path)
        except OSError:
            return None
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_nlink == 0
            or (at.st_dev, at.st_ino) != (st.st_dev, st.st_ino)
            or st.st_size != pre.size
        ):
            return None  # taken back between our open and our lock
        try:
            mapping = _arena.map_file(pre.path)
        except OSError:  # replaced (by a link, say) since our open
            return None
        if (mapping.dev, mapping.ino, mapping.size) != (st.st_dev, st.st_ino, pre.size):
            return None
        claimed = True
        return OutFile("", pre.size, lease_id=pre.lease_id, path=pre.path, lock_fd=fd)
    finally:
        if not claimed:
            os.close(fd)


def claim_next(
    socket: str | Path, namespace: str, rank: int, size: int
) -> tuple[OutFile | None, PreLease | None]:
    """The file the previous save of this rank pre-leased from the daemon at ``socket``, if it can
    be used, and else the pre-lease that could not (for :func:`ask_next` to give back)."""
    k = key(socket, namespace, rank)
    with _lock:
        asking = _asking.pop(k, None)
    if asking is not None:  # (its errors are its own: logged, never the save's)
        concurrent.futures.wait([asking], timeout=ASKED_WAIT_S)
    pre = take(k)
    if pre is None:
        return None, None
    claimed = claim(pre, size)
    return claimed, (pre if claimed is None else None)


def ask_next(
    daemon: DaemonClient,
    namespace: str,
    rank: int,
    after: tuple[int, str],
    size: int,
    stale: list[PreLease],
    ask: bool,
    to: Mailbox | None = None,
) -> None:
    """Give back ``stale``; with ``ask``, ask for this rank's next file, granted when the save
    attempt ``after`` (step, attempt) commits, and keep it in this process, or send it ``to`` the
    trainer (PROCESS mode). Best effort: a save that finds none leases as before."""
    try:
        for unused in stale:
            _release_quietly(daemon, namespace, unused.lease_id)
        if not ask:
            return
        asked = time.monotonic()
        resp = daemon.lease(namespace, rank, size, after=after)
    except Exception as e:  # best effort: never fails the save that is being written
        logger.debug("%s: no pre-lease for the next save: %s", namespace, e)
        return
    if not resp.pending:  # a daemon that predates pre-leases granted a plain lease
        _release_quietly(daemon, namespace, resp.lease_id)
        return
    pre = PreLease(resp.lease_id, resp.path, resp.size, asked + resp.expires_in_s)
    if to is not None:
        if not send(to, pre):
            _release_quietly(daemon, namespace, pre.lease_id)
        return
    old = put(key(daemon.config.socket, namespace, rank), pre)
    if old is not None:
        _release_quietly(daemon, namespace, old.lease_id)


def _release_quietly(daemon: DaemonClient, namespace: str, lease_id: str) -> None:
    try:
        daemon.release(namespace, lease_id)
    except TierCkptError as e:  # the daemon takes it back by itself
        logger.debug("%s: could not release pre-lease %s: %s", namespace, lease_id, e)


class NextFile:
    """One writer's part in pre-leasing: which process staged its save, what ``stage`` claimed
    under, the pre-leases it could not use (given back off the stall), and, in DCP's helper
    process, the trainer's mailbox."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # ClientConfig.prelease
        self.staged_by: int | None = None  # the process that staged this save
        self.key: Key | None = None  # what stage() claimed under
        self.stale: list[PreLease] = []  # pre-leases stage() could not use
        self.mailbox: Mailbox | None = None  # PROCESS mode: the trainer's

    def staged(self) -> None:
        self.staged_by = os.getpid()

    def claim(self, socket: str | Path, namespace: str, rank: int, size: int) -> OutFile | None:
        """The file the previous save of this rank pre-leased, if it can be used (no round
        trip); one that cannot is given back by :meth:`ask`, off the stall."""
        if not self.enabled:
            return None
        k = self.key = key(socket, namespace, rank)
        self.stale += collect(k)  # sent by DCP's helper process (PROCESS mode)
        claimed, stale = claim_next(socket, namespace, rank, size)
        self.stale += [stale] if stale is not None else []
        return claimed

    def hand_over(self) -> NextFile:
        """A copy for the writer's pickled copy (PROCESS mode: DCP's helper process writes the
        save): it gives back the stale pre-leases, and sends the next one to this process."""
        moved = copy.copy(self)
        if self.enabled and self.key is not None:
            moved.mailbox = mailbox(self.key)
        self.stale = []  # the copy gives them back
        return moved

    def ask(
        self, daemon: DaemonClient, namespace: str, rank: int, after: tuple[int, str], size: int
    ) -> None:
        """After the seal: give back the stale pre-leases and ask for the next file (see
        :func:`ask_next`), kept here or sent to the trainer. Kept here, it is asked for on a
        thread of its own: the save goes on to its commit meanwhile (the round trip is not in
        the time until the step is committed), and the next claim waits for the answer."""
        stale, self.stale = self.stale, []
        here = self.enabled and self.staged_by == os.getpid()
        if here:
            k = key(daemon.config.socket, namespace, rank)
            ask = functools.partial(ask_next, daemon, namespace, rank, after, size, stale, True)
            try:
                asking = _ask_pool().submit(_logged, ask, namespace)
            except RuntimeError:  # the interpreter is shutting down: no new thread; asked here
                ask()
                return
            with _lock:
                _asking[k] = asking
            return
        to = self.mailbox
        ask_next(daemon, namespace, rank, after, size, stale, to is not None, to)


def wait_asked(timeout: float = ASKED_WAIT_S) -> None:
    """Wait (up to ``timeout``) until every pre-lease this process is asking for is answered,
    kept and the stale ones given back (what the daemon reports then includes them)."""
    with _lock:
        pending = list(_asking.values())
    concurrent.futures.wait(pending, timeout=timeout)


def _logged(ask: Callable[[], None], namespace: str) -> None:
    """``ask`` (:func:`ask_next`) on the asking thread: what it does not expect is logged, not
    kept in a future nobody reads."""
    try:
        ask()
    except BaseException:
        logger.warning("%s: asking for the next save's file failed", namespace, exc_info=True)


def _ask_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _asker
    with _lock:
        if _asker is None:
            _asker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tierckpt-prelease"
            )
        return _asker


def _forget_asking() -> None:
    global _asker, _lock
    # A forked child has none of the parent's threads, and the lock may have been held by one.
    _asker, _lock = None, threading.Lock()
    _asking.clear()


os.register_at_fork(after_in_child=_forget_asking)
