"""What a load's ``POST .../reads`` requests to its daemon may leave out or send early (issue 24,
goal 2; used by :meth:`DaemonClient.open_read <tierckpt_client.daemon_client.DaemonClient.open_read>`,
which sends, claims and gives back its pins sent ahead through :func:`pin_ahead` and
:func:`claimed`).

A load asks twice: for the step's metadata (``read_metadata``) and for a pin (``read_data``).

- **Stamps.** Each answer names the step's commit record in the tier directory as the daemon found
  it (:class:`~tierckpt_core.protocol.ReadStamp`). The daemon rewrites that record, as a new file,
  on every change of the step, and removes it when the step leaves its memory: while ``lstat``
  finds the same file, the step is as last answered, and the metadata request is not sent.
- **Pins sent ahead.** Then the pin that ``read_data`` asks for next is sent at once, without
  waiting for its answer: the daemon serves it while DCP plans the load, and ``read_data`` claims
  the answer (:func:`claim`). A first load of a step (or of a new version of it) sends its pin
  the same way as soon as the metadata's answer is in. A pin no load claims (a load that failed in DCP's planning, a reader
  dropped after ``read_metadata``) is given back when its answer is read: at this process's next
  request to a daemon, or when it exits.

Neither is trusted with a byte: the load's bytes are verified against the file records of the
pin's answer, which the daemon sends whenever the step is not the version the reader holds; a
stamp that lies (the directory is writable by the node's trainers) costs a clear error at worst
(DCP planned with the metadata of a step saved again since: ``MemorySource`` refuses it).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from tierckpt_client._uds_http import Answer, collect_owed
from tierckpt_client.config import ClientConfig
from tierckpt_core.errors import DaemonUnavailableError, TierCkptError
from tierckpt_core.protocol import ReadRequest, ReadResponse, ReadStamp

logger = logging.getLogger(__name__)

Key = tuple[str, str, int]  # (socket, namespace, step)


class Client(Protocol):
    """What the pins sent ahead use of a :class:`~tierckpt_client.daemon_client.DaemonClient`
    (which sends what this module decides)."""

    config: ClientConfig

    @property
    def _request(self) -> Callable[..., Any]: ...  # (DaemonClient._request: its keywords there)

    def _failed(self, e: OSError, what: str, limit: float) -> DaemonUnavailableError: ...

    def _decoded(self, answer: Answer, what: str, *, raw: bool = False) -> Any: ...


# What the daemons answered this process's reads of a step last: the version, and the step's
# commit record as the daemon found it then.
_STAMPS: OrderedDict[Key, tuple[str, ReadStamp]] = OrderedDict()
_STAMPS_MAX = 64
_LOCK = threading.Lock()
GIVE_BACK_S = 5.0  # the bound on releasing a pin sent ahead that no load claimed


def remember(key: Key, answer: ReadResponse) -> None:
    with _LOCK:
        if answer.stamp is None:
            _STAMPS.pop(key, None)
            return
        _STAMPS[key] = (answer.version, answer.stamp)
        _STAMPS.move_to_end(key)
        while len(_STAMPS) > _STAMPS_MAX:
            _STAMPS.popitem(last=False)


def unchanged(key: Key, version: str) -> bool:
    """Whether the daemon answered ``version`` for the step last and its commit record is the
    same file still."""
    with _LOCK:
        seen = _STAMPS.get(key)
    if seen is None or seen[0] != version:
        return False
    stamp = seen[1]
    try:
        st = os.lstat(stamp.path)
    except OSError:
        return False
    return (st.st_ino, st.st_ctime_ns, st.st_size) == (stamp.ino, stamp.ctime_ns, stamp.size)


class Ahead:
    """A pin sent ahead for the load that holds version ``known`` of a step: claimed by that
    load's ``read_data``, else given back (``give_back(answer)``) once its answer is read."""

    def __init__(self, key: Key, known: str, give_back: Callable[[Answer], None]) -> None:
        self.key, self.known, self.give_back = key, known, give_back
        self.pid = os.getpid()
        self.claimed = False
        self.answer: Answer | None = None
        self.error: BaseException | None = None
        self.arrived = threading.Event()

    def done(self, answer: Answer | None, error: BaseException | None) -> None:
        """The answer, read by whichever request of this process came first."""
        self.answer, self.error = answer, error
        with _LOCK:
            self.arrived.set()
            orphan = not self.claimed
            if orphan and _AHEAD.get(self.key) is self:
                del _AHEAD[self.key]
        if orphan and answer is not None:
            self.give_back(answer)

    def wait(self, timeout: float) -> bool:
        """Wait for the answer (read here, unless another thread is reading it)."""
        collect_owed()
        return self.arrived.wait(timeout)


_AHEAD: dict[Key, Ahead] = {}


def send_ahead(ahead: Ahead, send: Callable[[], None]) -> None:
    """Register ``ahead`` (a pin sent ahead of the same step before, unclaimed, is given back
    when its answer comes), then ``send`` it; one that cannot be sent is dropped."""
    with _LOCK:
        _AHEAD[ahead.key] = ahead
    try:
        send()
    except BaseException:
        with _LOCK:
            if _AHEAD.get(ahead.key) is ahead:
                del _AHEAD[ahead.key]
        raise


def claim(key: Key) -> Ahead | None:
    """The pin sent ahead for this step, now the caller's (None if there is none)."""
    with _LOCK:
        ahead = _AHEAD.pop(key, None)
        if ahead is None or ahead.pid != os.getpid() or ahead.arrived.is_set():
            return None  # (one that arrived unclaimed was given back already)
        ahead.claimed = True
        return ahead


def pin_ahead(client: Client, key: Key, version: str) -> bool:
    """Send the pin of the next ``open_read`` of version ``version`` of the step ``key`` names
    ahead through ``client`` (not waiting for its answer); False if it could not be sent."""
    _, namespace, step = key
    path = f"/v1/namespaces/{namespace}/steps/{step}/reads"
    ahead = Ahead(key, version, _give_back(client, namespace, step))
    body = ReadRequest(known=version, pin=True).model_dump()
    try:
        send_ahead(ahead, lambda: client._request("POST", path, body, later=True, done=ahead.done))
    except DaemonUnavailableError:
        return False  # asked when needed, as before: a daemon gone is the load's to handle
    return True


def claimed(client: Client, ahead: Ahead, known: str | None) -> ReadResponse | None:
    """The answer to the pin sent ahead, claimed by a load that holds version ``known`` (None:
    it was for another version, given back)."""
    _, namespace, step = ahead.key
    what = f"POST /v1/namespaces/{namespace}/steps/{step}/reads"
    limit = client.config.timeout_s
    if not ahead.wait(limit):
        raise DaemonUnavailableError(
            f"the tierckpt daemon at {client.config.socket} did not answer {what} within "
            f"{limit:.0f}s"
        )
    if ahead.answer is None:
        error = ahead.error if isinstance(ahead.error, OSError) else OSError(str(ahead.error))
        raise client._failed(error, what, limit) from ahead.error
    if ahead.known != known:
        _give_back(client, namespace, step)(ahead.answer)
        return None
    answer = ReadResponse.model_validate(client._decoded(ahead.answer, what))
    remember(ahead.key, answer)
    return answer


def _give_back(client: Client, namespace: str, step: int) -> Callable[[Answer], None]:
    """Release the pin in an answer to a pin sent ahead that no load claimed (and wait: what
    this process asks next does not see it)."""

    def give_back(answer: Answer) -> None:
        try:
            pin_id = ReadResponse.model_validate_json(answer[1]).pin_id
        except ValueError:
            return  # an error: no pin taken
        if pin_id is None:
            return
        path = f"/v1/namespaces/{namespace}/steps/{step}/pins/{pin_id}"
        try:
            # Bounded apart: it may run at exit (a daemon that hangs must not hold it up).
            client._request("DELETE", path, timeout=min(client.config.timeout_s, GIVE_BACK_S))
        except TierCkptError as e:
            logger.warning(
                "%s/step %d: could not give back a pin sent ahead of a load that did not "
                "read: %s (it expires by itself)",
                namespace,
                step,
                e,
            )

    return give_back


# After _uds_http's (atexit runs the last registered first): read the answers of pins sent
# ahead that no load claimed, so that they are given back; the rest is dropped there.
@atexit.register
def _give_back_at_exit() -> None:
    pid = os.getpid()
    with _LOCK:
        pending = any(a.pid == pid for a in _AHEAD.values())
    if pending:
        collect_owed(limit=2.0)
