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

The API server sends well-formed AdmissionReviews only, but anyone who reaches the webhook's port
can send anything: every field read here is checked for its type first, and a review or pod that is
not what it claims gets a refusal naming the field (never an exception, never a patch).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

API_VERSION = "admission.k8s.io/v1"  # the only one served (the chart's admissionReviewVersions)
# A Pod's deepest fields (affinity terms, ephemeral volume claims) sit ~15 levels below the review;
# anything far deeper is not a pod, and code that walks it must not recurse without a bound.
MAX_DEPTH = 64
# Objects and arrays in a body, counted before parsing ('{' and '[', those in strings too): a pod
# has hundreds; a crafted body of a million empty ones parses to ~25x its size.
MAX_CONTAINERS = 100_000
INJECT_LABEL = "tierckpt.io/inject"
CONTAINERS_ANNOTATION = "tierckpt.io/containers"
INJECTED_ANNOTATION = "tierckpt.io/injected"
VOLUME_NAME = "tierckpt"
SOCKET_ENV = "TIERCKPT_SOCKET"

Pod = dict[str, Any]
Patch = list[dict[str, Any]]


class InjectError(ValueError):
    """The pod asks for something the webhook cannot do (e.g. a container that does not exist), or
    the review or pod is malformed: the answer refuses it with this message."""


class BadReview(ValueError):
    """The body is not an AdmissionReview that can be answered (not JSON, or no request.uid)."""


_JSON_TYPES: dict[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def _expect(value: Any, want: type, path: str, *, nullable: bool = True) -> Any:
    """``value`` if it is of JSON type ``want`` (or null, where null means absent)."""
    if (value is None and nullable) or isinstance(value, want):
        return value
    got = _JSON_TYPES.get(type(value), type(value).__name__)
    raise InjectError(f"{path} is {got}, not {_JSON_TYPES[want]}")


def _objects(value: Any, path: str) -> list[dict[str, Any]]:
    """A list of objects (null: none)."""
    items: list[Any] = _expect(value, list, path) or []
    for i, item in enumerate(items):
        _expect(item, dict, f"{path}[{i}]", nullable=False)
    return items


def _check_pod(pod: Pod) -> None:
    """Refuse, naming the field, a pod whose fields :func:`mutate_pod` reads have other types."""
    meta = _expect(pod.get("metadata"), dict, "the pod's metadata") or {}
    _expect(meta.get("annotations"), dict, "the pod's metadata.annotations")
    spec = _expect(pod.get("spec"), dict, "the pod's spec") or {}
    for i, v in enumerate(_objects(spec.get("volumes"), "the pod's spec.volumes")):
        _expect(v.get("hostPath"), dict, f"the pod's spec.volumes[{i}].hostPath")
    security = _expect(spec.get("securityContext"), dict, "the pod's spec.securityContext") or {}
    _expect(
        security.get("supplementalGroups"),
        list,
        "the pod's spec.securityContext.supplementalGroups",
    )
    for i, c in enumerate(_objects(spec.get("containers"), "the pod's spec.containers")):
        _expect(c.get("name"), str, f"the pod's spec.containers[{i}].name")
        _objects(c.get("volumeMounts"), f"the pod's spec.containers[{i}].volumeMounts")
        _objects(c.get("env"), f"the pod's spec.containers[{i}].env")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests more than ``limit`` levels: iterative (no recursion on input), and
    holding one iterator per level, not the nodes (a crafted review has a million)."""
    stack: list[Iterator[Any]] = [iter((value,))]
    while stack:
        for node in stack[-1]:
            if isinstance(node, (dict, list)):
                if len(stack) > limit:
                    return True
                stack.append(iter(node.values() if isinstance(node, dict) else node))
                break
        else:
            stack.pop()
    return False


def parse_review(body: bytes) -> Any:
    """The JSON of a request body; :class:`BadReview` when it is not JSON or nests too deep to parse
    (the decoder's own recursion bound: a RecursionError, caught, not a crash), or holds more
    than :data:`MAX_CONTAINERS` objects and arrays."""
    if body.count(b"{") + body.count(b"[") > MAX_CONTAINERS:
        raise BadReview(f"more than {MAX_CONTAINERS} objects and arrays: not a Pod's review")
    try:
        return json.loads(body)
    except RecursionError:
        raise BadReview(
            f"the JSON nests too deep (an AdmissionReview nests < {MAX_DEPTH})"
        ) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise BadReview(f"not JSON: {e}") from None


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
    meta = _expect(pod.get("metadata"), dict, "the pod's metadata") or {}
    labels = _expect(meta.get("labels"), dict, "the pod's metadata.labels") or {}
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
    _check_pod(pod)
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


def admission_response(review: Any, settings: InjectSettings) -> dict[str, Any]:
    """The AdmissionReview (admission.k8s.io/v1) answering ``review``.

    Pods that did not opt in, and objects that are not pods, are allowed unchanged. A pod that
    opted in but cannot be onboarded is refused with the reason, rather than started without the
    daemon's socket (it would fail later, far from the cause); so is a review of another version or
    a malformed one. :class:`BadReview` when there is no ``request.uid`` to answer to.
    """
    request = review.get("request") if isinstance(review, dict) else None
    uid = request.get("uid") if isinstance(request, dict) else None
    if not isinstance(uid, str) or not uid:
        raise BadReview("not an AdmissionReview request: no request.uid")
    assert isinstance(review, dict) and isinstance(request, dict)
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    try:
        patch = _patch(review, request, settings)
    except InjectError as e:
        response["allowed"] = False
        response["status"] = {"code": 400, "message": f"tierckpt: {e}"}
    else:
        if patch:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _short(value: Any) -> str:
    """A client's value for a message: scalars shown (shortened), containers only named."""
    if isinstance(value, (dict, list)):
        return _JSON_TYPES[type(value)]
    text = repr(value[:80] if isinstance(value, str) else value)
    return text if len(text) <= 80 else text[:77] + "..."


def _patch(review: dict[str, Any], request: dict[str, Any], settings: InjectSettings) -> Patch:
    if _deeper_than(review, MAX_DEPTH):
        raise InjectError(f"the AdmissionReview nests deeper than {MAX_DEPTH} levels: not a Pod")
    version, kind = review.get("apiVersion"), review.get("kind")
    if version != API_VERSION or kind != "AdmissionReview":
        # The answer must be of the request's version, and only v1 is implemented (and asked for).
        raise InjectError(
            f"only {API_VERSION} AdmissionReview is served (admissionReviewVersions: [v1]), "
            f"not apiVersion {_short(version)} kind {_short(kind)}"
        )
    resource = _expect(request.get("kind"), dict, "request.kind") or {}
    if resource.get("kind") != "Pod" or resource.get("group", "") != "":
        return []
    pod = _expect(request.get("object"), dict, "request.object")
    return [] if pod is None else mutate_pod(pod, settings)
