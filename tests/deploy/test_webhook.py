"""The onboarding webhook: its mutation on real PyTorchJob / JobSet / Job pod specs, and the server
end to end (TLS with a self-signed certificate, a real AdmissionReview, on 127.0.0.1).

What a user would notice: an opted-in pod ends up able to reach its node's daemon (the tier
directory mounted at the daemon's path, the daemon's group, TIERCKPT_SOCKET), it is still a valid
Pod, its own settings are kept, and pods that did not opt in are not touched.
"""

from __future__ import annotations

import base64
import copy
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import kubernetes_validate
import pytest
import yaml
from webhook_server import Webhook

from tierckpt_webhook import InjectSettings, admission_response, mutate_pod
from tierckpt_webhook.mutate import BadReview, InjectError

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


def test_webhook_server_end_to_end(start_webhook: Callable[..., Webhook]) -> None:
    hook = start_webhook()
    url = hook.url
    with hook.client() as client:
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
    out = hook.output()
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


# Hardening: anyone who reaches the webhook's port can send anything. What a user would notice on
# the old server: a malformed body closed the connection with a traceback and no answer; any
# apiVersion was answered as if it were v1; every connection got a thread, forever while it
# trickled bytes, so enough slow clients took the pod (and with failurePolicy Fail, every labelled
# pod's creation) down.


def _post(client: httpx.Client, url: str, body: bytes) -> httpx.Response:
    return client.post(f"{url}/mutate", content=body, headers={"Content-Type": "application/json"})


def _refusal(r: httpx.Response, uid: str) -> str:
    """The message of a well-formed AdmissionReview refusal answering ``uid``."""
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == uid and response["allowed"] is False and "patch" not in response
    message: str = response["status"]["message"]
    return message


def test_malformed_reviews_are_answered_and_the_server_keeps_serving(
    start_webhook: Callable[..., Webhook],
) -> None:
    hook = start_webhook()
    listed = _review(PODS["job"])
    listed["request"]["object"] = [PODS["job"]]
    null_meta = _review(PODS["job"])
    null_meta["request"]["object"] = {**PODS["job"], "metadata": None}
    bad_labels = _review(PODS["job"])
    bad_labels["request"]["object"] = copy.deepcopy(PODS["job"])
    bad_labels["request"]["object"]["metadata"]["labels"] = ["tierckpt.io/inject"]
    bad_env = _review(PODS["job"])
    bad_env["request"]["object"] = copy.deepcopy(PODS["job"])
    bad_env["request"]["object"]["spec"]["containers"][0]["env"] = {"A": "1"}
    deep = _review(copy.deepcopy(PODS["job"]))  # parses, but nests far deeper than any Pod
    deep["request"]["object"]["spec"]["x"] = json.loads("[" * 200 + "]" * 200)
    too_deep = b'{"request": {"uid": "u", "object": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}"
    too_many = b'{"request": {"uid": "u", "object": [' + b"{}," * 200_000 + b"{}]}}"
    with hook.client() as client:
        url = hook.url
        for review, field in (
            (listed, "request.object is an array"),
            (bad_labels, "metadata.labels is an array"),
            (bad_env, "spec.containers[0].env is an object"),
            (deep, "nests deeper than 64 levels"),
        ):
            r = _post(client, url, json.dumps(review).encode())
            assert field in _refusal(r, review["request"]["uid"])
        # metadata: null counts as absent, like every null: no label, so left alone.
        r = _post(client, url, json.dumps(null_meta).encode())
        assert r.status_code == 200
        assert r.json()["response"] == {"uid": null_meta["request"]["uid"], "allowed": True}
        # No uid to answer to: 400 naming the problem.
        for body, error in (
            (too_deep, "nests too deep"),
            (too_many, "more than 100000 objects and arrays"),
            (b"[1, 2]", "no request.uid"),
            (b'{"request": {"uid": ["x"]}}', "no request.uid"),
            (b"\xff\xfe", "not JSON"),
        ):
            r = _post(client, url, body)
            assert r.status_code == 400 and error in r.json()["error"], (body[:40], r.text)
        # Still serving, on the same connection and on new ones.
        assert _post(client, url, json.dumps(_review(PODS["job"])).encode()).json()["response"][
            "patch"
        ]
        with hook.client() as fresh:
            assert fresh.get(f"{url}/healthz").json() == {"ok": True}
    out = hook.output()
    assert "Traceback" not in out and " ERROR " not in out, out
    assert "refused" in out and "patched" in out


def test_malformed_reviews_never_raise_past_admission_response() -> None:
    # The pure function, on shapes no API server sends: each is a refusal, a pass, or BadReview.
    deep = json.loads("[" * 900 + "]" * 900)
    pod = copy.deepcopy(PODS["job"])
    cases: list[Any] = [
        [],
        {"request": None},
        {"request": {"uid": 7}},
        {**_review(pod), "apiVersion": deep},
        {**_review(pod), "kind": {"a": deep}},
        {**_review(pod), "request": {**_review(pod)["request"], "kind": "Pod"}},
        {**_review(pod), "request": {**_review(pod)["request"], "object": "pod"}},
    ]
    for field in ("metadata", "spec"):
        for value in ([], "x", 1, True):
            review = _review(copy.deepcopy(pod))
            review["request"]["object"][field] = value
            cases.append(review)
    for field, value in (
        ("volumes", [None]),
        ("volumes", [{"name": "v", "hostPath": "/x"}]),
        ("securityContext", {"supplementalGroups": 5}),
        ("containers", {"name": "trainer"}),
        ("containers", [{"name": ["trainer"]}]),
        ("containers", [{"name": "trainer", "volumeMounts": [[]]}]),
    ):
        broken = copy.deepcopy(pod)
        broken["spec"][field] = value
        cases.append(_review(broken))
    for review in cases:
        try:
            answer = admission_response(review, SETTINGS)
        except BadReview:
            continue
        response = answer["response"]
        assert answer["apiVersion"] == "admission.k8s.io/v1" and "uid" in response
        assert response["allowed"] is False or "patch" not in response, review
        if response["allowed"] is False:
            assert response["status"]["message"].startswith("tierckpt: ")


def test_only_v1_admission_reviews_are_served(start_webhook: Callable[..., Webhook]) -> None:
    hook = start_webhook()
    with hook.client() as client:
        for version, kind in (
            ("admission.k8s.io/v1beta1", "AdmissionReview"),
            (None, "AdmissionReview"),
            ("admission.k8s.io/v1", "TokenReview"),
        ):
            review = _review(PODS["job"])
            review["apiVersion"] = version
            review["kind"] = kind
            r = client.post(f"{hook.url}/mutate", json=review)
            message = _refusal(r, review["request"]["uid"])
            assert "only admission.k8s.io/v1 AdmissionReview" in message, message
            assert repr(version) in message and repr(kind) in message


def test_oversized_bodies_and_heads_are_refused_unread(
    start_webhook: Callable[..., Webhook],
) -> None:
    hook = start_webhook()
    # Declared over the cap: refused before a byte of it is read, and the connection closed (what
    # follows is not a next request). The body is never sent.
    raw = socket.create_connection(("127.0.0.1", hook.port), timeout=30)
    with hook.trust.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (64 << 20))
        answer = b""
        while chunk := tls.recv(65536):  # to the end: the server closes the connection
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in head, head
    assert "at most" in json.loads(body)["error"]
    with hook.client() as client:
        # A head of 200 headers of 4 KiB (800 KiB; http.server alone would read up to 6 MiB):
        # cut off at 64 KiB.
        with pytest.raises(httpx.TransportError):
            client.get(f"{hook.url}/healthz", headers={f"x-{i}": "a" * 4096 for i in range(200)})
        assert client.get(f"{hook.url}/healthz").json() == {"ok": True}


def _trickle(hook: Webhook, handshaken: threading.Semaphore, ended: list[bool]) -> None:
    """A slow client: completes TLS, then sends a request one byte at a time, forever."""
    raw = socket.create_connection(("127.0.0.1", hook.port), timeout=120)
    with hook.trust.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        handshaken.release()
        tls.settimeout(0.3)
        deadline = time.monotonic() + 90
        head = b"POST /mutate HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100_000
        for i in range(len(head)):
            if time.monotonic() > deadline:
                return  # never cut off
            try:
                tls.sendall(head[i : i + 1])
                tls.recv(1)  # an answer or the end of the connection: the server gave up on it
            except TimeoutError:
                continue  # nothing yet: the next byte, 0.3 s later
            except OSError:
                pass
            ended.append(True)
            return


def test_slow_clients_cannot_exhaust_the_server(start_webhook: Callable[..., Webhook]) -> None:
    limit, slow = 4, 12
    hook = start_webhook("--max-connections", str(limit), "--request-timeout", "3")
    idle = hook.threads()
    handshaken = threading.Semaphore(0)
    ended: list[bool] = []
    clients = [
        threading.Thread(target=_trickle, args=(hook, handshaken, ended), daemon=True)
        for _ in range(slow)
    ]
    for t in clients:
        t.start()
    for _ in range(limit):  # every connection slot is held by a slow client
        assert handshaken.acquire(timeout=60)
    threads = [hook.threads()]
    # A normal review still gets its answer (after the slow clients ahead of it run out of time).
    with hook.client(timeout=60) as client:
        review = _review(PODS["job"])
        r = client.post(f"{hook.url}/mutate", json=review)
        assert r.status_code == 200 and r.json()["response"]["uid"] == review["request"]["uid"]
    for t in clients:
        while t.is_alive():
            threads.append(hook.threads())
            t.join(0.2)
    # Every slow client was cut off (one deadline per request, not per read), and the server never
    # had more than one thread per allowed connection.
    assert len(ended) == slow
    assert max(threads) <= idle + limit, threads
    out = hook.output()
    assert "Traceback" not in out and " ERROR " not in out, out
    assert f"all {limit} connections busy" in out
