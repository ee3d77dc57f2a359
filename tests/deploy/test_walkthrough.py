"""The operations guide's walkthrough values, rendered as written (issue 33 item 5): with
networkPolicy and podMonitor on and no metricsFrom, the Prometheus that scrapes the PodMonitor
must still be admitted to the port it scrapes."""

from __future__ import annotations

import re
from typing import Any

import yaml
from chart_kit import ROOT, render_mod


def walkthrough_values() -> dict[str, Any]:
    """The values block of step 2 of docs/operations.md's walkthrough (platform-values.yaml)."""
    text = (ROOT / "docs/operations.md").read_text()
    step = text[text.index("2. **Write your values**") :]
    block = re.search(r"```yaml\n(.*?)```", step, re.S)
    assert block is not None, "the walkthrough's values block is gone from docs/operations.md"
    values: dict[str, Any] = yaml.safe_load(block.group(1))
    return values


def _matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions In/Exists) against labels."""
    if selector is None:
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, vals = expr["key"], expr["operator"], expr.get("values", [])
        if (op == "In" and labels.get(key) not in vals) or (op == "Exists" and key not in labels):
            return False
        if (op == "NotIn" and labels.get(key) in vals) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def admitted(
    policy: dict[str, Any], namespace: dict[str, str], pod: dict[str, str], port: str
) -> bool:
    """Whether ``policy`` (its own namespace: its metadata's) lets a pod with labels ``pod`` in a
    namespace labelled ``namespace`` reach the named ``port`` of the pods it selects."""
    own_ns = policy["metadata"]["namespace"]
    for rule in policy["spec"].get("ingress") or []:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port for p in ports):
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            if "ipBlock" in peer:
                continue
            if "namespaceSelector" in peer:
                ns_ok = _matches(peer["namespaceSelector"], namespace)
            else:  # no namespaceSelector: the policy's own namespace only
                ns_ok = namespace.get("kubernetes.io/metadata.name") == own_ns
            if ns_ok and _matches(peer.get("podSelector"), pod):
                return True
    return False


def test_the_walkthrough_admits_its_prometheus_to_the_port_the_podmonitor_scrapes() -> None:
    values = walkthrough_values()
    assert values["networkPolicy"]["enabled"] and values["podMonitor"]["enabled"]
    assert not values["networkPolicy"].get("metricsFrom")  # the case the issue found broken
    objects = render_mod.objects(render_mod.render(values))
    (monitor,) = [o for o in objects if o["kind"] == "PodMonitor"]
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    (policy,) = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy"
        and _matches(o["spec"]["podSelector"], monitor["spec"]["selector"]["matchLabels"])
    ]
    # kube-prometheus-stack's Prometheus, in its own namespace (the operator's pod label).
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    prometheus = {"app.kubernetes.io/name": "prometheus", "prometheus": "kube-prometheus"}
    assert admitted(policy, monitoring, prometheus, port)
    # ... and the policy still keeps everyone else out.
    assert not admitted(policy, {"kubernetes.io/metadata.name": "team-a"}, {"app": "x"}, port)


def test_metrics_from_replaces_the_default_scrapers() -> None:
    values = walkthrough_values()
    values["networkPolicy"]["metricsFrom"] = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "obs"}}}
    ]
    objects = render_mod.objects(render_mod.render(values))
    (policy,) = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and "webhook" not in o["metadata"]["name"]
    ]
    obs = {"kubernetes.io/metadata.name": "obs"}
    assert admitted(policy, obs, {"app": "vmagent"}, "http")
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    assert not admitted(policy, monitoring, {"app.kubernetes.io/name": "prometheus"}, "http")
