"""/metrics on the TCP port parses as Prometheus text and moves when a save happens."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp
from prometheus_client.parser import text_string_to_metric_families

from tierckpt_client.dcp import TieredStorageWriter

from helpers import DaemonProcess, free_port

PORT = free_port()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.mark.daemon_settings(port=PORT, host="127.0.0.1", capacity="64M")
def test_metrics_move_with_a_save(client_env: DaemonProcess) -> None:
    before = _scrape(PORT)
    assert before[("tierckpt_capacity_bytes", ())] == 64 << 20
    assert before[("tierckpt_commits_total", ())] == 0
    sd = {"w": torch.randn(1 << 18), "extra": {"epoch": 1}}
    dcp.async_save(sd, storage_writer=TieredStorageWriter("m", 1), no_dist=True).result()
    after = _scrape(PORT)
    assert after[("tierckpt_commits_total", ())] == 1
    assert after[("tierckpt_leases_total", (("recycled", "false"),))] >= 1
    assert after[("tierckpt_memory_bytes", (("state", "committed"),))] >= 1 << 20
    assert after[("tierckpt_steps", (("state", "committed"),))] == 1
    assert after[("tierckpt_lease_seconds_count", ())] >= 1
    # The local API stays off the TCP port.
    assert httpx.get(f"http://127.0.0.1:{PORT}/v1/status", timeout=10).status_code == 403
