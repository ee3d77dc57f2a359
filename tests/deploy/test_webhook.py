"""The onboarding webhook: its mutation on real PyTorchJob / JobSet / Job pod specs, and the server
end to end (TLS with a self-signed certificate, a real AdmissionReview, on 127.0.0.1).

What a user would notice: an opted-in pod ends up able to reach its node's daemon (the tier
directory mounted at the daemon's path, the daemon's group, TIERCKPT_SOCKET), it is still a valid
Pod, its own settings are kept, and pods that did not opt in are not touched.
"""

from __future__ import annotations

import base64
import copy
import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tierckpt_daemon.webhook import InjectSettings, admission_response, mutate_pod
from tierckpt_daemon.webhook.mutate import InjectError

SAMPLES = Path(__file__).parent / "samples"
SETTINGS = InjectSettings(shm_dir="/dev/shm/tierckpt", group=10001)
K8S_VERSION = "1.30.0"


def _pod(template: dict[str, Any], owner: str, namespace: str) -> dict[str, Any]:
    """The Pod a controller creates from a pod template, as the API server sends it to the webhook."""
    meta = copy.deepcopy(template.get("metadata") or {})
    meta.update({"generateName": f"{owner}-", "namespace": namespace})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": copy.deepcopy(template["spec"]),
    }


def _sample_pods() -> dict[str, dict[str, Any]]:
    pods = {}
    ptj = yaml.safe_load((SAMPLES / "pytorchjob.yaml").read_text())
    for role, replica in ptj["spec"]["pytorchReplicaSpecs"].items():
        pods[f"pytorchjob-{role.lower()}"] = _pod(
            replica["template"], ptj["metadata"]["name"], "team-a"
        )
    jobset = yaml.safe_load((SAMPLES / "jobset.yaml").read_text())
    (rjob,) = jobset["spec"]["replicatedJobs"]
    pods["jobset"] = _pod(rjob["template"]["spec"]["template"], "pretrain-workers-0", "team-b")
    job = yaml.safe_load((SAMPLES / "job.yaml").read_text())
    pods["job"] = _pod(job["spec"]["template"], "finetune", "default")
    return pods


PODS = _sample_pods()


def _mutated(pod: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = jsonpatch.apply_patch(pod, mutate_pod(pod, SETTINGS))
    return result


def _injected_containers(pod: dict[str, Any]) -> list[str]:
    return [
        c["name"]
        for c in pod["spec"]["containers"]
        if {"name": "TIERCKPT_SOCKET", "value": "/dev/shm/tierckpt/daemon.sock"} in c.get("env", [])
        and any(m["mountPath"] == "/dev/shm/tierckpt" for m in c.get("volumeMounts", []))
    ]


@pytest.mark.parametrize("name", list(PODS))
def test_sample_pods_are_onboarded(name: str) -> None:
    before = PODS[name]
    after = _mutated(before)
    kubernetes_validate.validate(after, K8S_VERSION, strict=True)
    spec = after["spec"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == "tierckpt"]
    assert vol["hostPath"] == {"path": "/dev/shm/tierckpt", "type": "Directory"}
    assert 10001 in spec["securityContext"]["supplementalGroups"]
    want = ["trainer"] if name == "jobset" else [c["name"] for c in before["spec"]["containers"]]
    assert _injected_containers(after) == want
    assert after["metadata"]["annotations"]["tierckpt.io/injected"] == "true"
    # What the pod had stays: its volumes, groups, env, other annotations.
    for v in before["spec"].get("volumes", []):
        assert v in spec["volumes"]
    for g in (before["spec"].get("securityContext") or {}).get("supplementalGroups", []):
        assert g in spec["securityContext"]["supplementalGroups"]
    for c_before, c_after in zip(before["spec"]["containers"], spec["containers"], strict=True):
        for e in c_before.get("env", []):
            assert e in c_after["env"]
    for k, v in (before["metadata"].get("annotations") or {}).items():
        assert after["metadata"]["annotations"][k] == v
    # Admitted twice (a retried request, a second webhook pass): nothing more to do.
    assert mutate_pod(after, SETTINGS) == []


def test_jobset_sidecar_is_left_alone() -> None:
    after = _mutated(PODS["jobset"])
    (loader,) = [c for c in after["spec"]["containers"] if c["name"] == "loader"]
    assert "env" not in loader and "volumeMounts" not in loader


def test_pod_edited_by_hand_is_kept_as_is() -> None:
    pod = _mutated(PODS["job"])
    del pod["metadata"]["annotations"]
    pod["spec"]["volumes"][0]["name"] = "my-tier"
    pod["spec"]["containers"][0]["volumeMounts"][0]["name"] = "my-tier"
    patch = mutate_pod(pod, SETTINGS)
    assert patch == []  # it has all it needs: nothing added, its names kept


def test_unrelated_pods_are_left_alone() -> None:
    for label in (None, "false", "yes"):
        pod = copy.deepcopy(PODS["job"])
        if label is None:
            del pod["metadata"]["labels"]["tierckpt.io/inject"]
        else:
            pod["metadata"]["labels"]["tierckpt.io/inject"] = label
        assert mutate_pod(pod, SETTINGS) == []
        review = _review(pod)
        assert admission_response(review, SETTINGS)["response"] == {
            "uid": review["request"]["uid"],
            "allowed": True,
        }
    # Not a pod at all.
    review = _review({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}})
    review["request"]["kind"] = {"group": "", "version": "v1", "kind": "ConfigMap"}
    assert "patch" not in admission_response(review, SETTINGS)["response"]


def test_unknown_container_is_refused_with_the_reason() -> None:
    pod = copy.deepcopy(PODS["jobset"])
    pod["metadata"]["annotations"]["tierckpt.io/containers"] = "trainr"
    with pytest.raises(InjectError, match="trainr"):
        mutate_pod(pod, SETTINGS)
    response = admission_response(_review(pod), SETTINGS)["response"]
    assert response["allowed"] is False
    assert (
        "trainr" in response["status"]["message"]
        and "trainer, loader" in response["status"]["message"]
    )


def _review(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": pod["metadata"].get("namespace", "default"),
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
            "object": pod,
            "dryRun": False,
        },
    }


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tierckpt-webhook.tierckpt.svc")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("tierckpt-webhook.tierckpt.svc"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "tls.crt", tmp / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_webhook_server_end_to_end(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    port = _free_port()
    # The console script's entry point, as the chart's Deployment runs it.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tierckpt_daemon.webhook.server import main; sys.exit(main())",
            "--host", "127.0.0.1", "--port", str(port),
            "--tls-cert", str(cert), "--tls-key", str(key),
            "--shm-dir", "/dev/shm/tierckpt", "--group", "10001",
        ],
        env={**os.environ},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    trust = ssl.create_default_context(cafile=str(cert))
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=trust, timeout=10) as client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    assert client.get(f"{url}/healthz").json() == {"ok": True}
                    break
                except httpx.TransportError:
                    assert proc.poll() is None, proc.communicate()[0]
                    assert time.monotonic() < deadline, "webhook did not start"
                    time.sleep(0.1)
            # A client that does not trust the certificate is refused at the handshake.
            with pytest.raises(httpx.ConnectError), httpx.Client(timeout=5) as untrusting:
                untrusting.get(f"{url}/healthz")
            for name, pod in PODS.items():
                review = _review(pod)
                r = client.post(f"{url}/mutate", json=review)
                assert r.status_code == 200, r.text
                answer = r.json()
                assert (
                    answer["apiVersion"] == "admission.k8s.io/v1"
                    and answer["kind"] == "AdmissionReview"
                )
                response = answer["response"]
                assert response["uid"] == review["request"]["uid"] and response["allowed"] is True
                assert response["patchType"] == "JSONPatch"
                patch = json.loads(base64.b64decode(response["patch"]))
                after = jsonpatch.apply_patch(pod, patch)
                assert after == _mutated(pod), name
                assert _injected_containers(after), name
            unrelated = copy.deepcopy(PODS["job"])
            del unrelated["metadata"]["labels"]["tierckpt.io/inject"]
            response = client.post(f"{url}/mutate", json=_review(unrelated)).json()["response"]
            assert "patch" not in response and response["allowed"] is True
            bad = client.post(
                f"{url}/mutate", content=b"{not json", headers={"Content-Type": "application/json"}
            )
            assert bad.status_code == 400 and "bad AdmissionReview" in bad.json()["error"]
    finally:
        proc.terminate()
        out = proc.communicate(timeout=10)[0].decode()
    assert "patched" in out and "left alone" in out


def test_null_fields_are_filled_not_appended_to() -> None:
    # What some generators emit: keys present with null values.
    pod = copy.deepcopy(PODS["job"])
    pod["spec"]["volumes"] = None
    pod["spec"]["securityContext"] = {"supplementalGroups": None}
    pod["spec"]["containers"][0]["env"] = None
    pod["spec"]["containers"][0]["volumeMounts"] = None
    pod["metadata"]["annotations"] = None
    after = _mutated(pod)
    assert after["spec"]["securityContext"]["supplementalGroups"] == [10001]
    assert _injected_containers(after) == ["trainer"]
    assert after["spec"]["volumes"][0]["name"] == "tierckpt"
