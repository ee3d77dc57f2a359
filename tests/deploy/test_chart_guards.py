"""The chart's guards and the webhook's availability (issue 33 item 15): values that would be
ignored or would disagree with what the chart sets are refused with a message naming them; the
webhook (failurePolicy Fail) gets a PodDisruptionBudget, spread and priority; NOTES.txt's
readiness check works against a real daemon with TLS on its port."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python
import pytest
from chart_kit import objects as _objects
from chart_kit import render_mod

from certs import CA, tls_settings
from helpers import DaemonProcess, free_port

SEED = "0123456789abcdef0123456789abcdef"
WEBHOOK = {"enabled": True, "tls": {"existingSecret": "hook-tls", "caBundle": "Q0E="}}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"daemon": {"capacity": "200%"}}, "/daemon/capacity"),
        ({"daemon": {"capacity": "0%"}}, "/daemon/capacity"),
        ({"runAsUser": 0}, "/runAsUser"),
        ({"podSecurityContext": {"runAsUser": 0}}, "podSecurityContext.runAsUser is set by"),
        ({"securityContext": {"runAsGroup": 0}}, "securityContext.runAsGroup is set by"),
        (
            {"extraEnv": [{"name": "TIERCKPT_CAPACITY", "value": "1G"}]},
            "extraEnv sets TIERCKPT_CAPACITY, which the chart sets itself",
        ),
        ({"extraEnv": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "A twice"),
    ],
)
def test_values_the_chart_would_ignore_or_contradict_are_refused(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render_mod.render(values)


def test_good_values_still_render() -> None:
    for capacity in ("100%", "0.5%", "40%", "16G"):
        _objects({"daemon": {"capacity": capacity}})
    objects = _objects({"extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}]})
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    env = [e["name"] for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert env.count("HTTPS_PROXY") == 1 and len(env) == len(set(env))


def test_the_webhook_has_a_disruption_budget_spread_and_priority() -> None:
    objects = _objects({"webhook": {**WEBHOOK, "replicas": 2}})
    (pdb,) = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    pod = deploy["spec"]["template"]
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == pod["metadata"]["labels"]
    # One replica: no budget (it would block every drain).
    assert not [
        o
        for o in _objects({"webhook": {**WEBHOOK, "replicas": 1}})
        if o["kind"] == "PodDisruptionBudget"
    ]


def _notes(values: dict[str, Any]) -> str:
    chart = helm_python.Chart.load(render_mod.CHART)
    out = chart.render(values=values, name="tierckpt", namespace="tierckpt", is_install=True)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


@pytest.mark.slow
def test_the_notes_readiness_check_works_with_tls(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    ca = CA.make(tmp_path, "cluster-ca")
    cert = ca.issue(tmp_path, "node0", dns=["tierckpt-peers.tierckpt.svc"], ips=[])
    port = free_port()
    make_node(port=port, **tls_settings(ca, cert))
    values = {
        "daemon": {"port": port},
        "replication": {"enabled": True, "tokenSeed": SEED, "tls": {"secretName": "peer-tls"}},
    }
    command = re.search(r'python -c "(.*)"', _notes(values))
    assert command is not None
    # The command as the pod runs it, with the CA where the chart mounts it here.
    code = command.group(1).replace("/var/run/tierckpt/peer-tls/ca.crt", str(ca.path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == 'b\'{"status":"ready"}\''
