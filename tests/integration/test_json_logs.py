"""The daemon's JSON log lines carry what they are about (namespace, step, rank, attempt) as keys
of their own, so a log pipeline filters on them without parsing messages."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt_client.dcp import TieredStorageWriter

from helpers import DaemonProcess


def _lines(d: DaemonProcess) -> list[dict[str, Any]]:
    docs = []
    for line in d.log_path.read_text().splitlines():
        doc = json.loads(line)  # every line is one JSON document
        assert isinstance(doc, dict), line
        docs.append(doc)
    return docs


@pytest.mark.daemon_settings(log_json="true", log_level="DEBUG", capacity="64M")
def test_a_saves_log_lines_carry_namespace_step_rank_and_attempt(client_env: DaemonProcess) -> None:
    sd = {"w": torch.randn(1 << 12), "extra": {"epoch": 1}}
    dcp.async_save(sd, storage_writer=TieredStorageWriter("llama", 7), no_dist=True).result()
    docs = _lines(client_env)
    commits = [d for d in docs if d["msg"].startswith("llama/step 7 committed")]
    assert len(commits) == 1, [d["msg"] for d in docs]
    commit = commits[0]
    assert commit["level"] == "INFO"
    assert commit["namespace"] == "llama" and commit["step"] == 7
    attempt = commit["attempt"]
    assert isinstance(attempt, str) and attempt
    assert "rank" not in commit  # a commit is every rank's: no rank is made up
    seals = [d for d in docs if d.get("rank") is not None and "sealed" in d["msg"]]
    assert [(d["namespace"], d["step"], d["rank"], d["attempt"]) for d in seals] == [
        ("llama", 7, 0, attempt)
    ]
    # Lines about nothing in particular have none of the keys.
    start = next(d for d in docs if d["msg"].startswith("tierckpt daemon serving"))
    assert not {"namespace", "step", "rank", "attempt"} & start.keys()
