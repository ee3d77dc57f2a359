#!/usr/bin/env bash
# One prepared run of bench/peers.py (issue 35) on a quiet host without network: tierckpt beside
# DLRover Flash Checkpoint, LM Resiliency's GEMINI and torch's reused stager, CPU tensors, 1 rank,
# 64 MiB and 1 GiB. Everything it writes goes to $OUT (default bench/results/peers-device):
# env.txt, peers.{json,md,txt}, run.log.
#
# The host has torch, grpcio, numpy, httpx, h11, prometheus-client and pytest; what the daemon
# and the peers import beyond that comes as wheels in .whl/ (the daemon's) and .whl-peers/
# (dlrover, lm-resiliency, requests, urllib3, charset-normalizer, certifi, psutil, packaging),
# installed with --no-deps into $SITE (default /tmp/site).
#
#   bash bench/peers_device.sh                 # ~2-3 min on a 16-core host; bounded at ~4 min
#   SMOKE=1 bash bench/peers_device.sh         # 8 MiB, 3 rounds (a check of the script)
#   WHEELS=0 PYTHON=venv/bin/python bash ...   # skip the install (an environment that has them)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench/results/peers-device}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/run.log"; }

if [ "${WHEELS:-1}" = 1 ]; then
    for dir in .whl .whl-peers; do
        if compgen -G "$dir/*.whl" >/dev/null; then
            log "installing $(ls $dir/*.whl | wc -l) wheels from $dir into $SITE"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$SITE" $dir/*.whl 2>&1 | tail -5 | tee -a "$OUT/run.log"
        else
            log "no wheels in $dir"
        fi
    done
    export PYTHONPATH=$SITE:$PWD/core:$PWD/client:$PWD/daemon
else
    export PYTHONPATH=$PWD/core:$PWD/client:$PWD/daemon
fi
export PYTHONUNBUFFERED=1

{
    nproc
    free -g
    df -h /dev/shm 2>&1
    uptime
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__)
for m in ("tierckpt_daemon.api.app", "tierckpt_client.dcp", "grpc", "dlrover",
          "dlrover.trainer.torch.flash_checkpoint.ddp", "lm_resiliency.checkpointing"):
    try:
        mod = importlib.import_module(m)
        print("import", m, "ok", getattr(mod, "__version__", ""))
    except Exception as e:
        print("import", m, "Error:", type(e).__name__, e)
EOF
} >"$OUT/env.txt" 2>&1
log "environment: $(grep -E '^python' "$OUT/env.txt")"
if grep -q "^import .* Error:" "$OUT/env.txt"; then
    log "an import failed (see env.txt; peers.py skips that peer and says why)"
fi

if [ "${SMOKE:-0}" = 1 ]; then
    ARGS="--smoke"
else
    ARGS="--sizes ${SIZES:-64,1024} --iters ${ITERS:-10} --warmup 2"
fi
log "peers.py $ARGS"
(cd bench && timeout 240 "$PY" peers.py $ARGS --out "$OUT/peers.json" --md "$OUT/peers.md") \
    >"$OUT/peers.txt" 2>&1
log "bench: exit $? (a timeout is 124)"
# The table and the skipped peers (the peers' own logging stays in peers.txt).
sed -n '/^Medians/,$p' "$OUT/peers.txt" | tee -a "$OUT/run.log"
log "done"
