#!/usr/bin/env bash
# CI: build the wheel, install it the way the image does (deploy/image/requirements.txt with
# hashes, then the wheel without dependencies) into a fresh virtual environment, and check that
# torch is absent, the dependencies are complete (pip check) and both console scripts run. Also
# checks that the lock covers the `daemon` extra as pyproject.toml declares it today.
set -euo pipefail
cd "$(dirname "$0")/../.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python3 -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" .
wheel=("$work"/dist/tierckpt-*.whl)
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install --quiet --disable-pip-version-check --require-hashes --only-binary=:all: \
  -r deploy/image/requirements.txt
"$py" -m pip install --quiet --disable-pip-version-check --no-deps "${wheel[0]}"
"$py" -m pip check
if "$py" -c "import torch" 2>/dev/null; then
  echo "torch is installed by the daemon's install step; it must not be" >&2
  exit 1
fi
"$work/venv/bin/tierckpt-daemon" --help >/dev/null
"$work/venv/bin/tierckpt-webhook" --help >/dev/null
python3 - "${wheel[0]}" <<'PY'
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

# Every requirement of the daemon's install (base + the `daemon` extra) must be pinned in the lock.
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = Parser().parsestr(
        z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    )
locked = {
    line.split("==")[0].strip().lower().replace("_", "-")
    for line in Path("deploy/image/requirements.txt").read_text().splitlines()
    if "==" in line and not line.startswith((" ", "#"))
}
needed = []
for raw in meta.get_all("Requires-Dist") or []:
    req = Requirement(raw)
    if req.marker is None or req.marker.evaluate({"extra": "daemon"}):
        needed.append(req.name.lower().replace("_", "-"))
missing = sorted(set(needed) - locked)
if missing:
    sys.exit(f"deploy/image/requirements.txt lacks {missing}: run deploy/image/lock.sh")
print(f"wheel {Path(sys.argv[1]).name}: daemon install without torch, {len(needed)} requirements locked")
PY
