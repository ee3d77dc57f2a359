"""deploy/render.py builds values as `helm template -f ... --set ...` does (issue 33 item 4),
checked against Helm's own parser and renderer (helm-python-sdk): every case below renders the
same objects as Helm given the one --set expression that means the same (a values file written as
the assignments it holds, then each --set, in order: what strvals.ParseInto does into a map)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from chart_kit import render_mod

WEBHOOK_TLS = "webhook.tls.existingSecret=hook-tls,webhook.tls.caBundle=Q0E="


# (values files as the assignments they hold, the --set flags)
CASES: dict[str, tuple[list[str], list[str]]] = {
    # The issue's cases: a --set replaced the file's whole `daemon:` block (capacity fell back to
    # 40%), and dropped the webhook.
    "set-keeps-siblings": (["daemon.capacity=30%,daemon.logLevel=DEBUG"], ["daemon.keepLast=3"]),
    "webhook-replicas": (["webhook.enabled=true," + WEBHOOK_TLS], ["webhook.replicas=3"]),
    "two-files": (["daemon.capacity=30%,persist.url=file:///mnt/a", "persist.every=5"], []),
    "list-index": (["extraArgs={--log-level,INFO}"], ["extraArgs[1]=DEBUG"]),
    "list-of-maps": ([], ["extraEnv[0].name=FOO,extraEnv[0].value=bar", "extraEnv[1].name=X"]),
    "types": (
        ["replication.tokenSeed=0123456789abcdef0123456789abcdef"],
        ["daemon.prefault=false,daemon.port=9000,replication.enabled=true"],
    ),
    "tolerations": ([], ["tolerations[0].key=gpu,tolerations[0].operator=Exists"]),
}


def _as_file(tmp_path: Path, i: int, assignments: str) -> Path:
    path = tmp_path / f"values-{i}.yaml"
    path.write_text(yaml.safe_dump(helm_python.parse_set_string(assignments)))
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_builds_values_as_helm_does(case: str, tmp_path: Path) -> None:
    files, sets = CASES[case]
    paths = [_as_file(tmp_path, i, f) for i, f in enumerate(files)]
    ours = render_mod.render(render_mod.build_values(paths, sets))
    helms = render_mod.render(helm_python.parse_set_string(",".join([*files, *sets])))
    assert ours == helms


def test_the_issue_example_keeps_the_files_capacity(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "values.yaml"
    path.write_text("daemon:\n  capacity: 30%\n  keepLast: 5\n")
    assert render_mod.main(["-f", str(path), "--set", "daemon.keepLast=3"]) == 0
    docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    env = {
        e["name"]: e.get("value") for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert (env["TIERCKPT_CAPACITY"], env["TIERCKPT_KEEP_LAST"]) == ("30%", "3")


def test_set_string_and_a_bad_set_are_reported(capsys: Any) -> None:
    values = render_mod.build_values([], ["daemon.keepLast=3"], ["podLabels.team=007"])
    assert values == {"daemon": {"keepLast": 3}, "podLabels": {"team": "007"}}
    assert render_mod.main(["--set", "daemon=5", "--set", "daemon.keepLast=1"]) == 2
    assert "daemon" in capsys.readouterr().err
