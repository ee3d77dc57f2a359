#!/usr/bin/env bash
# Regenerate the image's pinned, hashed dependency files from pyproject.toml (needs uv:
# `pip install uv`, and the package index). Commit the result; the Dockerfile installs exactly them.
#   requirements.txt: the daemon's runtime (the base dependencies and the `daemon` extra)
#   build.txt:        the wheel's build backend (hatchling)
# --universal: one file for every platform the image is built for (amd64 and arm64).
set -euo pipefail
cd "$(dirname "$0")/../.."
common=(--universal --python-version 3.11 --generate-hashes --custom-compile-command deploy/image/lock.sh)
uv pip compile "${common[@]}" pyproject.toml --extra daemon -o deploy/image/requirements.txt
uv pip compile "${common[@]}" deploy/image/build.in -o deploy/image/build.txt
