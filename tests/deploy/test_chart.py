"""The Helm chart, rendered offline as CI and a GitOps tool would render it.

Helm comes from `helm-python-sdk` (Helm's library, bundled; no binary, no cluster). Every object of
every render is validated strictly against the Kubernetes API schema (kubernetes-validate), the
default render must equal deploy/kubernetes/ (which is generated from it), and the values platform
teams set (peer token, shared file system, monitoring, NetworkPolicy) must show up where a
cluster would act on them.
"""

from __future__ import annotations

import base64
import re
from typing import Any

# Both come with the `test` extra: a missing one fails the run rather than skipping the checks.
import helm_python
import kubernetes_validate
import pytest
import yaml
from chart_kit import ROOT, exported_metrics, render_mod
from chart_kit import objects as _objects
from chart_kit import one as _one

K8S_VERSION = "1.30.0"
SEED = "0123456789abcdef0123456789abcdef"


# Non-default value sets a platform team would use.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "multi-node-gitops": {
        "replication": {"enabled": True, "replicas": 2, "tokenSeed": SEED},
        "persist": {"url": "s3://ckpt-bucket/team-a", "every": 5},
        "s3": {"region": "us-west-2", "credentialsSecret": "tierckpt-s3"},
        "networkPolicy": {
            "enabled": True,
            "metricsFrom": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                    }
                }
            ],
        },
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True, "noDurableStepMinutes": 30},
        "webhook": {
            "enabled": True,
            "tls": {"existingSecret": "webhook-tls", "caBundle": "LS0tLS1CRUdJTi0tLS0t"},
            "namespaceSelector": {"matchLabels": {"tierckpt.io/training": "enabled"}},
            "networkPolicy": {"from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}]},
        },
    },
    "fsx-shared-fs": {
        "persist": {"url": "file:///mnt/fsx/checkpoints"},
        "extraVolumes": [{"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}}],
        "extraVolumeMounts": [{"name": "fsx", "mountPath": "/mnt/fsx"}],
        "extraArgs": ["--log-level", "DEBUG"],
        "nodeSelector": {
            "kubernetes.io/os": "linux",
            "node.kubernetes.io/instance-type": "p5.48xlarge",
        },
        "podSecurityContext": {"supplementalGroups": [5000]},
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainer": {"resources": {"limits": {"cpu": "100m", "memory": "32Mi"}}},
        "revisionHistoryLimit": 3,
    },
    "peer-tls": {
        "replication": {"enabled": True, "tokenSeed": SEED, "tls": {"secretName": "peer-tls"}},
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
    },
    "existing-secret-webhook": {
        "replication": {"enabled": True, "existingSecret": "my-token", "existingSecretKey": "peer"},
        "webhook": {"enabled": True, "certManager": {"enabled": True}},
        "prometheusRule": {"enabled": True},
    },
}


def _daemon(objs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = _one(objs, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "daemon"]
    return pod, container


def test_chart_lints_strictly() -> None:
    report = helm_python.lint(render_mod.CHART, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_object_validates_strictly(name: str) -> None:
    objs = _objects(VALUE_SETS[name])
    assert any(o["kind"] == "DaemonSet" for o in objs)
    for obj in objs:
        if obj["apiVersion"].split("/")[0] in ("monitoring.coreos.com", "cert-manager.io"):
            # No schema for the Prometheus operator's or cert-manager's CRDs offline: check the
            # metadata as ObjectMeta (and the specs' content in the tests below).
            meta_only = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
            kubernetes_validate.validate(meta_only, K8S_VERSION, strict=True)
            assert isinstance(obj["spec"], dict) and obj["spec"]
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_default_render_is_deploy_kubernetes() -> None:
    want = render_mod.plain_manifests()
    have = render_mod.current_plain()
    stale = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    assert not stale, (
        f"deploy/kubernetes/ differs from the chart in {stale}: run `python deploy/render.py --write`"
    )


def test_no_secret_without_replication() -> None:
    objs = _objects({})
    assert not [o for o in objs if o["kind"] == "Secret"]
    pod, container = _daemon(objs)
    assert "peer-token" not in {v["name"] for v in pod["volumes"]}
    assert not any(e["name"].startswith("TIERCKPT_PEER") for e in container["env"])


def test_replication_without_a_token_source_fails_with_a_clear_error() -> None:
    with pytest.raises(helm_python.HelmRenderError, match=r"replication\.existingSecret"):
        render_mod.render({"replication": {"enabled": True}})


def test_generated_token_is_stable_across_renders_and_rolls_pods_when_it_changes() -> None:
    values = {"replication": {"enabled": True, "tokenSeed": SEED}}

    def token_and_checksum(v: dict[str, Any]) -> tuple[str, str]:
        objs = _objects(v)
        secret = _one(objs, "Secret")
        token = base64.b64decode(secret["data"]["token"]).decode()
        annotations = _one(objs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
        return token, annotations["checksum/peer-token"]

    first, second = token_and_checksum(values), token_and_checksum(values)
    assert first == second  # what Argo CD / Flux see on every sync: no drift
    token, checksum = first
    assert len(token) >= 32 and SEED not in token
    rotated = token_and_checksum({"replication": {"enabled": True, "tokenSeed": SEED + "-2"}})
    assert rotated[0] != token and rotated[1] != checksum  # a new token rolls the pods
    # Another release in another namespace gets another token from the same seed.
    other = render_mod.render(values, name="ckpt", namespace="team-b")
    assert (
        base64.b64decode(_one(render_mod.objects(other), "Secret")["data"]["token"]).decode()
        != token
    )
    explicit = token_and_checksum({"replication": {"enabled": True, "token": "t" * 40}})
    assert explicit[0] == "t" * 40


def test_existing_secret_is_mounted_and_no_secret_is_made() -> None:
    objs = _objects(VALUE_SETS["existing-secret-webhook"])
    assert not [o for o in objs if o["kind"] == "Secret" and "peer" in o["metadata"]["name"]]
    pod, container = _daemon(objs)
    (vol,) = [v for v in pod["volumes"] if v["name"] == "peer-token"]
    assert vol["secret"]["secretName"] == "my-token"
    assert vol["secret"]["items"] == [{"key": "peer", "path": "token"}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TIERCKPT_PEER_TOKEN_FILE"] == "/var/run/tierckpt/peer-token/token"


def test_multi_node_settings() -> None:
    objs = _objects(VALUE_SETS["multi-node-gitops"])
    _, container = _daemon(objs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TIERCKPT_PEERS"] == "dns:tierckpt-peers.tierckpt.svc.cluster.local:8474"
    assert env["TIERCKPT_NODE_NAME"] == "$(POD_IP):8474"
    assert env["TIERCKPT_REPLICAS"] == "2"
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("TIERCKPT_NODE_NAME")  # $(POD_IP) expands
    (service,) = [o for o in objs if o["metadata"]["name"] == "tierckpt-peers"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert "TIERCKPT_REPLICATION_MAX_RATE" not in env  # unpaced unless asked


def test_replication_pacing_values_map_to_the_daemon_settings() -> None:
    values = {
        "replication": {
            "enabled": True,
            "tokenSeed": SEED,
            "maxRate": "1G",
            "inflightBytes": "8M",
            "fetchMaxRate": "4G",
        }
    }
    _, container = _daemon(_objects(values))
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TIERCKPT_REPLICATION_MAX_RATE"] == "1G"
    assert env["TIERCKPT_REPLICATION_INFLIGHT_BYTES"] == "8M"
    assert env["TIERCKPT_PEER_FETCH_MAX_RATE"] == "4G"
    with pytest.raises(helm_python.HelmValuesError, match="maxRate"):
        render_mod.render({"replication": {"enabled": True, "tokenSeed": SEED, "maxRate": "fast"}})


def test_peer_tls_mounts_the_secret_and_switches_probes_and_scrapes_to_https() -> None:
    objs = _objects(VALUE_SETS["peer-tls"])
    pod, container = _daemon(objs)
    (vol,) = [v for v in pod["volumes"] if v["name"] == "peer-tls"]
    assert vol["secret"]["secretName"] == "peer-tls"
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "peer-tls"]
    assert mount == {
        "name": "peer-tls",
        "mountPath": "/var/run/tierckpt/peer-tls",
        "readOnly": True,
    }
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TIERCKPT_PEER_TLS_CERT"] == "/var/run/tierckpt/peer-tls/tls.crt"
    assert env["TIERCKPT_PEER_TLS_KEY"] == "/var/run/tierckpt/peer-tls/tls.key"
    assert env["TIERCKPT_PEER_TLS_CA"] == "/var/run/tierckpt/peer-tls/ca.crt"
    assert env["TIERCKPT_PEER_TLS_SERVER_NAME"] == "tierckpt-peers.tierckpt.svc"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS", probe
    for kind, key in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        (endpoint,) = _one(objs, kind)["spec"][key]
        assert endpoint["scheme"] == "https"
        assert endpoint["tlsConfig"] == {
            "ca": {"secret": {"name": "peer-tls", "key": "ca.crt"}},
            "serverName": "tierckpt-peers.tierckpt.svc",
        }
    # Off by default: plain HTTP probes, no TLS settings.
    _, plain = _daemon(_objects(VALUE_SETS["multi-node-gitops"]))
    assert "scheme" not in plain["readinessProbe"]["httpGet"]
    assert not [e for e in plain["env"] if e["name"].startswith("TIERCKPT_PEER_TLS")]


def test_shared_file_system_is_mounted_where_persist_url_points() -> None:
    objs = _objects(VALUE_SETS["fsx-shared-fs"])
    pod, container = _daemon(objs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    path = env["TIERCKPT_PERSIST_URL"].removeprefix("file://")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (mount,) = [m for m in mounts if path.startswith(m + "/")]
    (vol,) = [v for v in pod["volumes"] if v["name"] == mounts[mount]]
    assert vol["persistentVolumeClaim"]["claimName"] == "fsx-claim"
    assert container["args"] == ["--log-level", "DEBUG"]
    assert pod["securityContext"]["supplementalGroups"] == [5000]
    assert pod["securityContext"]["runAsUser"] == 10001  # the chart's ids stay
    assert container["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (init,) = pod["initContainers"]
    assert init["resources"]["limits"] == {"cpu": "100m", "memory": "32Mi"}  # merged with defaults
    assert _one(objs, "DaemonSet")["spec"]["revisionHistoryLimit"] == 3


def test_default_node_selector_is_linux() -> None:
    pod, _ = _daemon(_objects({}))
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}


def test_network_policy_admits_only_daemons_and_scrapers_to_the_port() -> None:
    objs = _objects(VALUE_SETS["multi-node-gitops"])
    (policy,) = [
        o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "tierckpt"
    ]
    ds = _one(objs, "DaemonSet")
    selector = ds["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    daemons, scrapers = policy["spec"]["ingress"]
    assert daemons["from"] == [{"podSelector": {"matchLabels": selector}}]
    assert scrapers["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }
    for rule in (daemons, scrapers):
        assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert not [o for o in _objects({}) if o["kind"] == "NetworkPolicy"]


def test_webhook_network_policy_opens_only_its_port() -> None:
    # On by default with the webhook: its pods take the HTTPS port only, from anywhere (the API
    # server cannot be named) unless webhook.networkPolicy.from narrows it.
    objs = _objects(VALUE_SETS["existing-secret-webhook"])
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    deployment = _one(objs, "Deployment")
    assert policy["metadata"]["name"] == "tierckpt-webhook"
    assert policy["spec"]["podSelector"] == deployment["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"port": "https", "protocol": "TCP"}]}]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert [p["name"] for p in container["ports"]] == ["https"]
    # The daemon's pods are not selected by it, nor the webhook's by the daemon's policy.
    daemons = _one(objs, "DaemonSet")["spec"]["selector"]["matchLabels"]
    assert not policy["spec"]["podSelector"]["matchLabels"].items() <= daemons.items()
    narrowed = [
        o
        for o in _objects(VALUE_SETS["multi-node-gitops"])
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "tierckpt-webhook"
    ]
    assert narrowed[0]["spec"]["ingress"] == [
        {
            "ports": [{"port": "https", "protocol": "TCP"}],
            "from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}],
        }
    ]
    off = {**VALUE_SETS["existing-secret-webhook"]}
    off["webhook"] = {**off["webhook"], "networkPolicy": {"enabled": False}}
    assert not [o for o in _objects(off) if o["kind"] == "NetworkPolicy"]
    assert not [o for o in _objects({}) if o["kind"] == "NetworkPolicy"]  # no webhook: none


def test_prometheus_rule_alerts_useexported_metrics() -> None:
    objs = _objects(VALUE_SETS["multi-node-gitops"])
    rule = _one(objs, "PrometheusRule")
    rules = rule["spec"]["groups"][0]["rules"]
    alerts = {r["alert"]: r["expr"] for r in rules}
    assert {
        "TierckptPersistentTierUnhealthy",
        "TierckptUploadsFailing",
        "TierckptNoDurableStep",
        "TierckptCapacityNearlyFull",
        "TierckptPeersUnreachable",
        "TierckptVerificationFailures",
        "TierckptBackgroundThreadDied",
    } <= alerts.keys()
    assert alerts["TierckptNoDurableStep"] == "tierckpt_due_steps_since_durable > 3"
    assert {r["alert"]: r.get("for") for r in rules}["TierckptNoDurableStep"] == "30m"
    exported = exported_metrics()
    for alert, expr in alerts.items():
        if alert in ("TierckptDaemonUnavailable", "TierckptMetricsDown"):
            continue  # about the daemon being gone: it exports nothing then (checked below)
        used = set(re.findall(r"\btierckpt_\w+", expr))
        assert used and used <= exported, (alert, used - exported)
    # A daemon that is down exports nothing: these two use what the cluster records of it, for
    # this release's DaemonSet and pods only.
    ds = _one(objs, "DaemonSet")["metadata"]
    assert alerts["TierckptDaemonUnavailable"] == (
        "kube_daemonset_status_number_unavailable"
        f'{{namespace="{ds["namespace"]}", daemonset="{ds["name"]}"}} > 0'
    )
    assert alerts["TierckptMetricsDown"] == (
        f'up{{namespace="{ds["namespace"]}", pod=~"{ds["name"]}-.*"}} == 0'
    )
    # Alerts about a tier or peers that are not configured are left out.
    plain = {
        r["alert"]
        for r in _one(_objects({"prometheusRule": {"enabled": True}}), "PrometheusRule")["spec"][
            "groups"
        ][0]["rules"]
    }
    assert (
        "TierckptPersistentTierUnhealthy" not in plain and "TierckptPeersUnreachable" not in plain
    )
    assert "TierckptDaemonUnavailable" in plain  # no scrape needed: kube-state-metrics
    assert "TierckptMetricsDown" not in plain  # nothing scrapes the daemons without a monitor
    # Both monitors scrape the named port.
    assert _one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert _one(objs, "ServiceMonitor")["spec"]["endpoints"][0]["port"] == "http"


def test_schema_rejects_unknown_values() -> None:
    with pytest.raises(helm_python.HelmValuesError, match="extraVolume"):
        render_mod.render({"extraVolume": []})


def test_webhook_render() -> None:
    objs = _objects(VALUE_SETS["multi-node-gitops"])
    (config,) = [o for o in objs if o["kind"] == "MutatingWebhookConfiguration"]
    (hook,) = config["webhooks"]
    assert hook["objectSelector"] == {"matchLabels": {"tierckpt.io/inject": "true"}}
    assert hook["namespaceSelector"]["matchLabels"] == {"tierckpt.io/training": "enabled"}
    (never,) = hook["namespaceSelector"]["matchExpressions"]
    assert never["operator"] == "NotIn" and set(never["values"]) == {"tierckpt", "kube-system"}
    assert hook["rules"][0]["resources"] == ["pods"] and hook["rules"][0]["operations"] == [
        "CREATE"
    ]
    assert hook["clientConfig"]["caBundle"] == "LS0tLS1CRUdJTi0tLS0t"
    deployment = _one(objs, "Deployment")
    pod = deployment["spec"]["template"]
    assert pod["spec"]["containers"][0]["command"] == ["tierckpt-webhook"]
    assert pod["spec"]["volumes"][0]["secret"]["secretName"] == "webhook-tls"
    # The webhook's pods are neither daemons (DaemonSet, peers Service) nor admitted as peers.
    selector = _one(objs, "DaemonSet")["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= pod["metadata"]["labels"].items()
    # The webhook onboards with the daemon's own path and group.
    args = pod["spec"]["containers"][0]["args"]
    assert "--shm-dir=/dev/shm/tierckpt" in args and "--group=10001" in args
    with_cm = _objects(VALUE_SETS["existing-secret-webhook"])
    config = _one(with_cm, "MutatingWebhookConfiguration")
    assert (
        config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        == "tierckpt/tierckpt-webhook"
    )
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    cert = _one(with_cm, "Certificate")
    assert "tierckpt-webhook.tierckpt.svc" in cert["spec"]["dnsNames"]
    with pytest.raises(helm_python.HelmRenderError, match=r"webhook\.enabled needs TLS"):
        render_mod.render({"webhook": {"enabled": True}})


def test_one_version_everywhere() -> None:
    from tierckpt_core import __version__

    chart = yaml.safe_load((render_mod.CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"ARG VERSION={__version__}\n" in dockerfile
    assert f"## [{__version__}]" in (ROOT / "CHANGELOG.md").read_text()
