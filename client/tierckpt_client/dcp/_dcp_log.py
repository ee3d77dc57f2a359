"""DCP's method logger, kept from building log records that nothing receives.

torch wraps each step of a DCP save and load (``async_save``, the stage, every planning step,
and ``_stateful_to_state_dict`` once per top-level key of the state dict) in
``_dcp_method_logger``, which writes a DEBUG record at the start and at the end of each. Its
logger (``c10d-NullHandler-dcp_logger``) is set to DEBUG, does not propagate, and has only a
``NullHandler`` unless a destination was registered in torch's ``_log_handlers``: every record
is built (a frame walk, a ``LogRecord``) and dropped. Measured on the 2-core box: a wrapped call
cost 3.3x as much with those records as without; an ``async_save`` of 16 top-level tensors makes
about 20 such calls on the training thread, before it returns.

:func:`drop_discarded_debug_records` raises that logger's level to INFO when every handler it
has is a ``NullHandler`` and it does not propagate (nothing could see a DEBUG record); its error
records (``log_exceptions``) still pass. A logger given a real handler is left as it is.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

_DONE = False
_LOCK = threading.Lock()


def drop_discarded_debug_records() -> None:
    """Once per process: see the module docstring."""
    global _DONE
    if _DONE:
        return
    with _LOCK:
        if _DONE:
            return
        _DONE = True
        try:
            from torch.distributed.checkpoint.logger import _dcp_logger
        except ImportError:  # another torch: nothing to do
            return
        if not isinstance(_dcp_logger, logging.Logger) or _dcp_logger.propagate:
            return
        handlers = _dcp_logger.handlers
        if not handlers or not all(type(h) is logging.NullHandler for h in handlers):
            return
        if _dcp_logger.getEffectiveLevel() <= logging.DEBUG:
            _dcp_logger.setLevel(logging.INFO)
            logger.debug("DCP's method logger has only a NullHandler: its DEBUG records skipped")
