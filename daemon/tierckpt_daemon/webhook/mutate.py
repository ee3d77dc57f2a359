"""The webhook's mutation: what a trainer pod needs to use its node's daemon, as a JSON Patch.

Pure functions of the pod and the settings (no I/O, no torch), so the same code that runs in the
cluster is tested against real PyTorchJob / JobSet / Job pod specs.

What an opted-in pod gets (each only where it is missing, so a pod edited by hand, or admitted
twice, is left as it is):

- a hostPath volume of the tier directory (``type: Directory``: the pod fails to start, visibly,
  on a node where the DaemonSet has not created it) mounted at the same path in the selected
  containers, because the daemon hands out absolute paths of shard files in it;
- the daemon's group in ``securityContext.supplementalGroups``: the socket and shard files are
  mode 0660/0750, owned by that group;
- ``TIERCKPT_SOCKET`` in the selected containers.

Opt-in is explicit: the label ``tierckpt.io/inject: "true"`` (the webhook's objectSelector sends
only such pods, and this code checks again). ``tierckpt.io/containers`` (an annotation, comma
separated) names the containers to inject; without it, every container (not init containers).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

INJECT_LABEL = "tierckpt.io/inject"
CONTAINERS_ANNOTATION = "tierckpt.io/containers"
INJECTED_ANNOTATION = "tierckpt.io/injected"
VOLUME_NAME = "tierckpt"
SOCKET_ENV = "TIERCKPT_SOCKET"

Pod = dict[str, Any]
Patch = list[dict[str, Any]]


class InjectError(ValueError):
    """The pod asks for something the webhook cannot do (e.g. a container that does not exist)."""


@dataclass(frozen=True)
class InjectSettings:
    """What the DaemonSet provides on every node (the chart passes its own values)."""

    shm_dir: str = "/dev/shm/tierckpt"
    group: int = 10001

    @property
    def socket(self) -> str:
        return self.shm_dir.rstrip("/") + "/daemon.sock"


def _pointer(token: str) -> str:
    """One JSON Pointer reference token (RFC 6901): '~' and '/' escaped."""
    return token.replace("~", "~0").replace("/", "~1")


def wants_injection(pod: Pod) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(INJECT_LABEL, "")).lower() == "true"


def _selected(pod: Pod) -> list[int]:
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    names = [
        n.strip() for n in str(annotations.get(CONTAINERS_ANNOTATION, "")).split(",") if n.strip()
    ]
    if not names:
        return list(range(len(containers)))
    index = {c.get("name"): i for i, c in enumerate(containers)}
    missing = [n for n in names if n not in index]
    if missing:
        raise InjectError(
            f"{CONTAINERS_ANNOTATION} names {', '.join(missing)}, which the pod does not have "
            f"(its containers: {', '.join(str(n) for n in index)})"
        )
    return [index[n] for n in names]


def mutate_pod(pod: Pod, settings: InjectSettings) -> Patch:
    """The JSON Patch (RFC 6902) that onboards ``pod``; [] for a pod that did not opt in."""
    if not wants_injection(pod):
        return []
    spec = pod.get("spec") or {}
    selected = _selected(pod)
    shm_dir = settings.shm_dir.rstrip("/")
    ops: Patch = []

    # The volume: reuse one the pod already has for the tier directory (by hand, or an earlier
    # admission), else add ours.
    volumes = spec.get("volumes") or []
    volume = next(
        (
            v.get("name")
            for v in volumes
            if str((v.get("hostPath") or {}).get("path", "")).rstrip("/") == shm_dir
        ),
        None,
    )
    if volume is None:
        if any(v.get("name") == VOLUME_NAME for v in volumes):
            raise InjectError(f"the pod has a volume named {VOLUME_NAME!r} that is not {shm_dir}")
        volume = VOLUME_NAME
        new = {"name": volume, "hostPath": {"path": shm_dir, "type": "Directory"}}
        ops.append(
            {"op": "add", "path": "/spec/volumes/-", "value": new}
            if spec.get("volumes") is not None
            else {"op": "add", "path": "/spec/volumes", "value": [new]}
        )

    # The group. (A key present with null counts as missing: "add" replaces it.)
    security = spec.get("securityContext")
    groups = (security or {}).get("supplementalGroups")
    if security is None:
        ops.append(
            {
                "op": "add",
                "path": "/spec/securityContext",
                "value": {"supplementalGroups": [settings.group]},
            }
        )
    elif groups is None:
        ops.append(
            {
                "op": "add",
                "path": "/spec/securityContext/supplementalGroups",
                "value": [settings.group],
            }
        )
    elif settings.group not in groups:
        ops.append(
            {
                "op": "add",
                "path": "/spec/securityContext/supplementalGroups/-",
                "value": settings.group,
            }
        )

    # The mount and the socket, per selected container.
    containers = spec.get("containers") or []
    for i in selected:
        c = containers[i]
        base = f"/spec/containers/{i}"
        mounts = c.get("volumeMounts")
        if not any(str(m.get("mountPath", "")).rstrip("/") == shm_dir for m in mounts or []):
            mount = {"name": volume, "mountPath": shm_dir}
            ops.append(
                {"op": "add", "path": f"{base}/volumeMounts/-", "value": mount}
                if mounts is not None
                else {"op": "add", "path": f"{base}/volumeMounts", "value": [mount]}
            )
        env = c.get("env")
        if not any(e.get("name") == SOCKET_ENV for e in env or []):
            var = {"name": SOCKET_ENV, "value": settings.socket}
            ops.append(
                {"op": "add", "path": f"{base}/env/-", "value": var}
                if env is not None
                else {"op": "add", "path": f"{base}/env", "value": [var]}
            )

    if ops:
        metadata = pod.get("metadata") or {}
        mark = {"op": "add", "value": "true"}
        if metadata.get("annotations") is None:
            ops.append(
                {**mark, "path": "/metadata/annotations", "value": {INJECTED_ANNOTATION: "true"}}
            )
        else:
            ops.append({**mark, "path": f"/metadata/annotations/{_pointer(INJECTED_ANNOTATION)}"})
    return ops


def admission_response(review: dict[str, Any], settings: InjectSettings) -> dict[str, Any]:
    """The AdmissionReview (admission.k8s.io/v1) answering ``review``.

    Pods that did not opt in, and objects that are not pods, are allowed unchanged. A pod that
    opted in but cannot be onboarded is refused with the reason, rather than started without the
    daemon's socket (it would fail later, far from the cause).
    """
    request = review.get("request")
    if not isinstance(request, dict) or "uid" not in request:
        raise ValueError("not an AdmissionReview request: no request.uid")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    kind = request.get("kind") or {}
    obj = request.get("object")
    if kind.get("kind") == "Pod" and kind.get("group", "") == "" and isinstance(obj, dict):
        try:
            patch = mutate_pod(obj, settings)
        except InjectError as e:
            response["allowed"] = False
            response["status"] = {"code": 400, "message": f"tierckpt: {e}"}
        else:
            if patch:
                response["patchType"] = "JSONPatch"
                response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {
        "apiVersion": review.get("apiVersion", "admission.k8s.io/v1"),
        "kind": "AdmissionReview",
        "response": response,
    }
