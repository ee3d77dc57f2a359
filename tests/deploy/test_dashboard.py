"""The Grafana dashboard (deploy/grafana/): it queries only metrics the daemon exports, has the
replication and per-namespace panels, filters the per-namespace ones by a `namespace` variable, and
its panels do not overlap."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from chart_kit import ROOT, exported_metrics

DASHBOARD = json.loads((ROOT / "deploy/grafana/tierckpt-dashboard.json").read_text())
# The series with a namespace label (metrics.py: only these two, to keep cardinality bounded).
PER_NAMESPACE = {
    "tierckpt_seconds_since_committed_step",
    "tierckpt_seconds_since_durable_step",
    "tierckpt_due_steps_since_durable",
}


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("expr", "definition") and isinstance(v, str):
                yield v
            else:
                yield from _exprs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _exprs(v)


def _panels() -> list[dict[str, Any]]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def _metrics(panel: dict[str, Any]) -> set[str]:
    return {m for e in _exprs(panel.get("targets", [])) for m in re.findall(r"\btierckpt_\w+", e)}


def test_every_queried_metric_isexported_metrics() -> None:
    exported = exported_metrics()
    assert PER_NAMESPACE | {"tierckpt_build_info", "tierckpt_replication_skips_total"} <= exported
    used = {m for e in _exprs(DASHBOARD) for m in re.findall(r"\btierckpt_\w+", e)}
    assert used and not used - exported, sorted(used - exported)


def test_replication_panels() -> None:
    used = set().union(*(_metrics(p) for p in _panels()))
    assert {
        "tierckpt_replicated_bytes_total",
        "tierckpt_replicated_steps_total",
        "tierckpt_replication_queue_steps",
        "tierckpt_replication_failures_total",
        "tierckpt_replication_skips_total",
        "tierckpt_upload_skips_total",
        "tierckpt_peer_hydrated_bytes_total",
        "tierckpt_build_info",
    } <= used
    titles = {p["title"] for p in DASHBOARD["panels"] if p["type"] == "row"}
    assert {"Replication", "Namespaces"} <= titles


def test_per_namespace_panels_filter_by_the_namespace_variable() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    ns = variables["namespace"]
    assert ns["type"] == "query" and ns["multi"] and ns["includeAll"]
    assert re.findall(r"\btierckpt_\w+", ns["definition"])[0] in PER_NAMESPACE
    panels = [p for p in _panels() if _metrics(p) & PER_NAMESPACE]
    assert len(panels) == 3
    for p in panels:
        for e in _exprs(p["targets"]):
            assert 'namespace=~"$namespace"' in e and 'instance=~"$instance"' in e, e


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (p["title"], cells[(x, y)])
                cells[(x, y)] = p["title"]
