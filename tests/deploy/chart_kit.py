"""The deploy tests' kit: the repository's root, ``deploy/render.py`` loaded once as a module
(it is a script, not a package), and the rendered objects of a values set."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _load_render() -> Any:
    spec = importlib.util.spec_from_file_location(
        "tierckpt_deploy_render", ROOT / "deploy/render.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


render_mod = _load_render()


def objects(values: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    """The objects the chart renders with ``values`` (``kw``: ``name=``, ``namespace=``)."""
    out: list[dict[str, Any]] = render_mod.objects(render_mod.render(values, **kw))
    return out


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of ``kind`` among ``objs``."""
    (obj,) = [o for o in objs if o["kind"] == kind]
    return obj


def exported_metrics() -> set[str]:
    """The names of the series the daemon exports, read from ``metrics.py`` (a counter's with
    ``_total``, a histogram's three)."""
    source = (ROOT / "daemon/tierckpt_daemon/metrics.py").read_text()
    suffixes = {"Counter": ["_total"], "Histogram": ["_bucket", "_sum", "_count"]}
    return {
        name + suffix
        for kind, name in re.findall(
            r'\b(Counter|Histogram|GaugeMetricFamily|CounterMetricFamily)\(\s*"(tierckpt_\w+)"',
            source,
        )
        for suffix in suffixes.get(kind, ["_total"] if kind == "CounterMetricFamily" else [""])
    }
