"""Preemption: record the scheduler's signal, act on it where every rank can agree.

A signal handler runs between two bytecodes of whatever the main thread was doing: in the middle
of a forward pass on one rank, inside an all-gather on another. No collective may run there, so
the handler only records the signal; the :class:`~tierckpt_client.checkpointer.Checkpointer`
all-reduces the flag at the next ``save(step, ...)``, a point every rank reaches in the same order,
and all ranks then save that step, wait until it is durable and exit together.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from enum import IntEnum
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client._save_loop import SaveFailedError
from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import (
    DaemonUnavailableError,
    NotReplicatedError,
    PersistentTierError,
    StepNotFoundError,
)
from tierckpt_core.protocol import StepState

logger = logging.getLogger(__name__)

POLL_S = 0.1

# The tensors of the last few agreements, kept alive on purpose. gloo's worker thread drops its
# reference to a collective's tensors a moment after the caller's wait returns; if that is the
# last reference, it decrefs the Python object from that thread, and if the interpreter is
# already exiting (the all-reduce just before a preempted rank's sys.exit), taking the GIL there
# ends the thread inside C++ and the process aborts with SIGABRT ("terminate called without an
# active exception", seen in a core dump) instead of exiting with its code.
_KEPT: list[torch.Tensor] = []


def _all_reduce_int(value: int, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup) -> int:
    flag = torch.tensor([value], dtype=torch.int32)
    dist.all_reduce(flag, op=op, group=group)
    _KEPT.append(flag)
    del _KEPT[:-8]  # each lives for 8 more agreements: long after gloo let go of it
    return int(flag.item())


class PreemptionWatcher:
    """Handlers for ``signals`` that set a flag; the previous handlers come back on uninstall."""

    def __init__(self, signals: Sequence[int]) -> None:
        self.signals = list(signals)
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "Checkpointer created outside the main thread: signal handlers cannot be "
                "installed, so preemption signals (%s) are not handled",
                ", ".join(signal.Signals(s).name for s in self.signals),
            )
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only record: the main thread may be anywhere, including inside a collective.
        self.received.append(signum)

    def describe(self) -> str:
        names = sorted({signal.Signals(s).name for s in self.received})
        return ", ".join(names) if names else "on another rank"

    def agreed(self, group: dist.ProcessGroup | None) -> bool:
        """Whether any rank of ``group`` recorded a signal (every rank must call this; with no
        signals watched, as on every rank of a job that turned handling off, no collective)."""
        if not self.signals:
            return False
        mine = 1 if self.received else 0
        if group is None:
            return bool(mine)
        return bool(_all_reduce_int(mine, dist.ReduceOp.MAX, group))


class Outcome(IntEnum):
    """Where a preempted step ended up on one rank, ordered so that the job's is the minimum."""

    FAILED = 0  # not saved, or a persistent tier is configured and the step missed the deadline
    MEMORY_ONLY = 1  # committed in the node's memory (and its replicas); no persistent tier
    DURABLE = 2  # complete in the persistent tier


def wait_durable(
    namespace: str,
    step: int,
    config: ClientConfig,
    deadline_s: float,
    group: dist.ProcessGroup | None,
) -> Outcome:
    """Ask this rank's daemon to persist ``step`` now and wait until it is durable; then agree
    with the other ranks on the worst outcome. A daemon with no persistent tier cannot do more
    than hold the committed step in memory: that rank's outcome is ``MEMORY_ONLY`` at once."""
    local = _wait_local(namespace, step, config, time.monotonic() + deadline_s)
    if group is None:
        return local
    return Outcome(_all_reduce_int(int(local), dist.ReduceOp.MIN, group))


def _wait_local(namespace: str, step: int, config: ClientConfig, deadline: float) -> Outcome:
    client = DaemonClient.shared(config)
    try:
        if client.status().persistent is None:
            return _memory_only(client, namespace, step, config)
        client.persist(namespace, step)  # jump the queue; a no-op if already queued or durable
    except DaemonUnavailableError:
        if config.persist_url:
            # The writer saved straight to the persistent tier: durable when the save returned.
            logger.warning("%s: daemon unreachable; step %d was written direct", namespace, step)
            return Outcome.DURABLE
        logger.error("%s: daemon unreachable and no persistent tier: step %d", namespace, step)
        return Outcome.FAILED
    except PersistentTierError as e:
        logger.error(
            "%s: step %d is only in memory (%s); it survives this process, not the node",
            namespace,
            step,
            e,
        )
        return Outcome.FAILED
    while True:
        info = client.step(namespace, step)
        if info.state == StepState.DURABLE:
            logger.warning("%s: step %d is durable", namespace, step)
            return Outcome.DURABLE
        if time.monotonic() > deadline:
            logger.error(
                "%s: step %d not durable within the preemption deadline (state %s)",
                namespace,
                step,
                info.state.value,
            )
            return Outcome.FAILED
        time.sleep(POLL_S)


def _memory_only(client: DaemonClient, namespace: str, step: int, config: ClientConfig) -> Outcome:
    """The daemon has no persistent tier: the step is as safe as it gets once it is committed in
    memory (the daemon replicates it on its own, where it has peers)."""
    try:
        info = client.step(namespace, step)
    except StepNotFoundError:
        if config.persist_url:
            # The daemon had no room and the writer saved straight to the trainer's persistent
            # tier: durable when the save returned.
            return Outcome.DURABLE
        raise
    if info.state in (StepState.COMMITTED, StepState.DURABLE):
        return Outcome.MEMORY_ONLY
    logger.error("%s: step %d is not committed (state %s)", namespace, step, info.state.value)
    return Outcome.FAILED


def replicates(config: ClientConfig) -> bool:
    """Whether a preempted save waits for its replicas: where this rank's daemon replicates
    committed steps to a peer and has no persistent tier (with one, the deadline is for the
    upload, and the replicas go on in the background unwaited); False when it cannot say
    (unreachable: the save degrades anyway)."""
    try:
        st = DaemonClient.shared(config).status()
    except DaemonUnavailableError:
        return False
    rep = st.replication
    return st.persistent is None and rep is not None and rep.replicas > 0 and len(rep.peers) > 1


def memory_only_warning(namespace: str, step: int) -> str:
    """The one warning a preempted job logs when its last save could not leave the node."""
    return (
        f"{namespace}: preempted at step {step}: the final save is in node memory (and on its "
        "replicas, if any) only, because no persistent tier is configured (TIERCKPT_PERSIST_URL "
        "on the daemon); a restart on this node resumes from it, a lost node loses it"
    )


def not_replicated(e: SaveFailedError) -> NotReplicatedError | None:
    """The error of a save that committed and waited for its replicas in vain, if that is all
    that failed (DCP wraps the coordinator's error in a CheckpointException)."""
    cause = e.__cause__
    if isinstance(cause, CheckpointException):
        errors = [exc for exc, _ in cause.failures.values()]
        if errors and all(isinstance(x, NotReplicatedError) for x in errors):
            return errors[0]  # type: ignore[return-value]
        return None
    return cause if isinstance(cause, NotReplicatedError) else None
