"""Threads that move checkpoint bytes in the background (uploads, hydration, replica pushes) run at
a lower CPU priority than the training processes on the node (``TIERCKPT_BACKGROUND_NICE``).

Linux keeps a niceness per thread, and a thread inherits its creator's, so the native threads a
worker starts (the S3 CRT client's event loops, created on first use) run niced too. Raising one's
own niceness needs no privilege. An idle node runs niced threads at full speed: the setting only
decides who yields when training and a transfer want the same core.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


def lower_priority(nice: int) -> None:
    """Set the calling thread's niceness to ``nice`` (0: leave it alone)."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as e:  # e.g. a seccomp profile that forbids it: run at normal priority
        logger.warning("could not lower the priority of a background thread: %s", e)


def background_pool(workers: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A thread pool whose threads run at niceness ``nice``."""
    return ThreadPoolExecutor(
        max(1, workers), thread_name_prefix=name, initializer=lower_priority, initargs=(nice,)
    )
