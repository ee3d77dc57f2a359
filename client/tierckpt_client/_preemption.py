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
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import DaemonUnavailableError, PersistentTierError
from tierckpt_core.protocol import StepState

logger = logging.getLogger(__name__)

POLL_S = 0.1


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
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32)
        if group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


def wait_durable(
    namespace: str,
    step: int,
    config: ClientConfig,
    deadline_s: float,
    group: dist.ProcessGroup | None,
) -> bool:
    """Ask this rank's daemon to persist ``step`` now and wait until it is durable; then agree
    with the other ranks. False if some rank's daemon did not make it durable in time."""
    ok = _wait_local(namespace, step, config, time.monotonic() + deadline_s)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _wait_local(namespace: str, step: int, config: ClientConfig, deadline: float) -> bool:
    client = DaemonClient.shared(config)
    try:
        client.persist(namespace, step)  # jump the queue; a no-op if already queued or durable
    except DaemonUnavailableError:
        if config.persist_url:
            # The writer saved straight to the persistent tier: durable when the save returned.
            logger.warning("%s: daemon unreachable; step %d was written direct", namespace, step)
            return True
        logger.error("%s: daemon unreachable and no persistent tier: step %d", namespace, step)
        return False
    except PersistentTierError as e:
        logger.error(
            "%s: step %d is only in memory (%s); it survives this process, not the node",
            namespace,
            step,
            e,
        )
        return False
    while True:
        info = client.step(namespace, step)
        if info.state == StepState.DURABLE:
            logger.warning("%s: step %d is durable", namespace, step)
            return True
        if time.monotonic() > deadline:
            logger.error(
                "%s: step %d not durable within the preemption deadline (state %s)",
                namespace,
                step,
                info.state.value,
            )
            return False
        time.sleep(POLL_S)
