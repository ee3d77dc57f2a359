"""Onboarding trainer pods without hand edits: a mutating admission webhook.

A pod that opts in (label ``tierckpt.io/inject: "true"`` on its template, which PyTorchJob, JobSet
and Job all copy onto their pods) gets what it needs to reach its node's daemon: the hostPath tier
directory mounted at the same path, the daemon's group as a supplemental group, and
``TIERCKPT_SOCKET``. The mutation (:mod:`.mutate`) is a pure function of the pod and the settings,
so it is tested against real pod specs without a cluster; :mod:`.server` serves it over TLS with
the standard library only (no torch, no web framework) from the daemon's image.
"""

from __future__ import annotations

from tierckpt_webhook.mutate import (
    INJECT_LABEL,
    InjectSettings,
    admission_response,
    mutate_pod,
)

__all__ = ["INJECT_LABEL", "InjectSettings", "admission_response", "mutate_pod"]
