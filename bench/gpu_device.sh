#!/usr/bin/env bash
# One prepared run on a CUDA machine (issue 36): the CUDA tests, then bench/gpu_staging.py with
# the asynchronous contenders and the restore into CUDA tensors. Everything it writes goes to
# $OUT (default bench/results/device): env.txt, tests.txt, gpu_staging.{json,md,txt}, run.log.
#
# The machine has torch (with CUDA), pytest, httpx, h11, prometheus-client and numpy; the rest of
# what the daemon and the client import comes as wheels in .whl/ (downloaded beforehand, no
# network there), installed into /tmp/site.
#
#   bash bench/gpu_device.sh              # ~4-5 min on an H100/H200; bounded at ~7.5 min
#   SMOKE=1 bash bench/gpu_device.sh      # 64 MiB only, 3 iterations (a check of the script)
#   RESTORE_ONLY=1 bash bench/gpu_device.sh  # ~2 min: the CUDA tests, then only the restore into
#                                         # CUDA tensors (phases, verify threads 16 and 4) and the
#                                         # asynchronous staging, at 64 MiB and 1 GiB
#   CUDA_VISIBLE_DEVICES= bash bench/gpu_device.sh   # no GPU: CUDA tests skip, bench says so
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/bench/results/device}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(($(date +%s) - T0)) s] $*" | tee -a "$OUT/run.log"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    log "installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tail -5 | tee -a "$OUT/run.log"
fi
export PYTHONPATH=/tmp/site:$PWD/core:$PWD/client:$PWD/daemon
export PYTHONUNBUFFERED=1

{
    nvidia-smi 2>&1 | head -20
    df -h /dev/shm /tmp 2>&1
    nproc
    free -g
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__,
      "cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
for m in ("tierckpt_daemon.api.app", "tierckpt_client.dcp", "tierckpt_client.checkpointer",
          "fastapi", "uvicorn", "pydantic", "xxhash", "tenacity"):
    mod = importlib.import_module(m)
    print("import", m, "ok", getattr(mod, "__version__", ""))
EOF
} >"$OUT/env.txt" 2>&1
log "environment: $(grep -E '^python' "$OUT/env.txt")"
if grep -q "Error" "$OUT/env.txt"; then
    log "an import failed (see env.txt)"
fi

EXTRA=()
if [ "${SMOKE:-0}" = 1 ]; then
    SIZES=0.0625 ITERS=3
elif [ "${RESTORE_ONLY:-0}" = 1 ]; then
    SIZES=${SIZES:-0.0625,1} ITERS=${ITERS:-7}
    EXTRA=(--restore-only --verify-threads "${VERIFY_THREADS:-0,4}")
else
    SIZES=${SIZES:-0.0625,1,4} ITERS=${ITERS:-5}
fi
BENCH_TIMEOUT=${BENCH_TIMEOUT:-$([ "${RESTORE_ONLY:-0}" = 1 ] && echo 120 || echo 300)}

log "CUDA tests"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -o addopts= -o timeout=120 \
    -W ignore::DeprecationWarning -W ignore::FutureWarning \
    tests/integration/test_cuda_paths.py \
    tests/unit/test_arena_pinning.py::test_cuda_tensors_stage_into_a_pinned_tier_file_and_restore_bit_exact \
    tests/unit/test_verified.py::test_check_all_checks_blocks_in_place_over_threads \
    >"$OUT/tests.txt" 2>&1
log "tests: exit $? ($(tail -1 "$OUT/tests.txt"))"

log "gpu_staging.py --sizes-gib $SIZES --iters $ITERS ${EXTRA[*]}"
timeout "$BENCH_TIMEOUT" "$PY" bench/gpu_staging.py --sizes-gib "$SIZES" --iters "$ITERS" \
    "${EXTRA[@]}" --out "$OUT/gpu_staging.json" >"$OUT/gpu_staging.txt" 2>&1
log "bench: exit $? (a timeout is 124; the sizes done are in the JSON)"
grep -E "GiB (tier_restore|:)" "$OUT/gpu_staging.txt" | tee -a "$OUT/run.log"
tail -25 "$OUT/gpu_staging.txt" | tee -a "$OUT/run.log"
log "done"
