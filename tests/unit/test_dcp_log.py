"""DCP's method logger builds no DEBUG record that nothing would receive (``dcp/_dcp_log``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.logger import _dcp_logger, _dcp_method_logger

from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _dcp_log


def as_torch_sets_it_up(monkeypatch: pytest.MonkeyPatch) -> logging.Logger:
    """torch's DCP logger as torch sets it up (DEBUG, a NullHandler, no propagation), without
    the handlers pytest's log capture adds for the test's call (set in the test's body)."""
    monkeypatch.setattr(_dcp_logger, "handlers", [logging.NullHandler()])
    monkeypatch.setattr(_dcp_logger, "propagate", False)
    monkeypatch.setattr(_dcp_logger, "level", logging.DEBUG)
    monkeypatch.setattr(_dcp_logger, "_cache", {})  # isEnabledFor's, as setLevel clears it
    monkeypatch.setattr(_dcp_log, "_DONE", False)
    return _dcp_logger


def _records_of_a_wrapped_call(log: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> int:
    made: list[logging.LogRecord] = []
    real = log.makeRecord

    def counted(*args: object, **kwargs: object) -> logging.LogRecord:
        rec = real(*args, **kwargs)  # type: ignore[arg-type]
        made.append(rec)
        return rec

    monkeypatch.setattr(log, "makeRecord", counted)
    _dcp_method_logger()(lambda: None)()
    return len(made)


@pytest.mark.parametrize("make", ["writer", "reader"])
def test_a_writer_or_reader_stops_records_only_a_null_handler_would_get(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, make: str
) -> None:
    dcp_logger = as_torch_sets_it_up(monkeypatch)
    assert _records_of_a_wrapped_call(dcp_logger, monkeypatch) == 2  # start and end, dropped
    config = ClientConfig(socket=tmp_path / "none.sock")
    if make == "writer":
        TieredStorageWriter("ns", step=1, config=config)
    else:
        TieredStorageReader("ns", step=1, config=config)
    assert _records_of_a_wrapped_call(dcp_logger, monkeypatch) == 0
    assert dcp_logger.isEnabledFor(logging.ERROR)  # DCP's exception records still pass
    assert torch.distributed.checkpoint.logger._dcp_logger is dcp_logger


def test_a_logger_with_a_real_handler_keeps_its_debug_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dcp_logger = as_torch_sets_it_up(monkeypatch)
    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    monkeypatch.setattr(dcp_logger, "handlers", [logging.NullHandler(), Keep()])
    _dcp_log.drop_discarded_debug_records()
    _dcp_method_logger()(lambda: None)()
    assert len(seen) == 2 and dcp_logger.isEnabledFor(logging.DEBUG)
