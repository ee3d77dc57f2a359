#!/usr/bin/env bash
# Run a Slurm job step with one tierckpt daemon per node of the allocation.
#
#   sbatch -N 4 --ntasks-per-node=8 --wrap \
#       "deploy/slurm/tierckpt-srun-wrapper.sh --ntasks-per-node=8 python train.py --config c.yaml"
#
# Everything after the wrapper's name goes to the training `srun` unchanged. The wrapper:
#   1. starts `tierckpt-daemon` once per node (a background `srun --overlap`, one task per node),
#   2. waits until every node's daemon answers on its Unix socket (`tierckpt status`),
#   3. runs `srun "$@"` with TIERCKPT_SOCKET exported to the training processes,
#   4. stops the daemons (SIGTERM) and, unless TIERCKPT_KEEP_TIER=1, removes the job's tier dir.
#
# Environment (optional): TIERCKPT_SHM_DIR (default /dev/shm/tierckpt-$SLURM_JOB_ID, one tier per
# job so that jobs sharing a node do not collide), TIERCKPT_CAPACITY, TIERCKPT_KEEP_LAST, and every
# other TIERCKPT_* daemon setting (srun passes the environment on). TIERCKPT_PORT defaults to 0
# (no TCP port: Slurm needs no probes, and two jobs on one node would fight over a fixed port).
# TIERCKPT_READY_TIMEOUT (seconds, default 120). `tierckpt-daemon` and `tierckpt` must be on PATH
# on every node (e.g. the job's virtual environment on a shared file system).
set -euo pipefail

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
  echo "tierckpt-srun-wrapper: run me inside a Slurm allocation (sbatch or salloc)" >&2
  exit 2
fi
if [[ $# -eq 0 ]]; then
  echo "usage: tierckpt-srun-wrapper.sh [SRUN_OPTIONS...] COMMAND [ARGS...]" >&2
  exit 2
fi

export TIERCKPT_SHM_DIR="${TIERCKPT_SHM_DIR:-/dev/shm/tierckpt-${SLURM_JOB_ID}}"
export TIERCKPT_SOCKET="${TIERCKPT_SOCKET:-${TIERCKPT_SHM_DIR}/daemon.sock}"
export TIERCKPT_PORT="${TIERCKPT_PORT:-0}"
nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
per_node=(--overlap --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1)

daemon_pid=""
cleanup() {
  local rc=$?
  if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    # srun forwards SIGTERM to the daemons; they finish in-flight requests and exit.
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  if [[ "${TIERCKPT_KEEP_TIER:-0}" != 1 ]]; then
    # Free the node memory the job's checkpoints held.
    srun "${per_node[@]}" rm -rf -- "$TIERCKPT_SHM_DIR" || true
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

srun "${per_node[@]}" --kill-on-bad-exit=1 --job-name=tierckpt-daemon tierckpt-daemon &
daemon_pid=$!

timeout_s="${TIERCKPT_READY_TIMEOUT:-120}"
# shellcheck disable=SC2016  # expanded by the remote shell
if ! srun "${per_node[@]}" bash -c '
    deadline=$((SECONDS + $1))
    until tierckpt status >/dev/null 2>&1; do
      if (( SECONDS > deadline )); then
        echo "tierckpt daemon on $(hostname) not ready at $TIERCKPT_SOCKET after $1s" >&2
        exit 1
      fi
      sleep 0.5
    done' _ "$timeout_s"; then
  echo "tierckpt-srun-wrapper: daemons did not start; see the tierckpt-daemon step's output" >&2
  exit 1
fi
echo "tierckpt-srun-wrapper: daemons ready on $nodes node(s), tier $TIERCKPT_SHM_DIR" >&2

srun "$@"
