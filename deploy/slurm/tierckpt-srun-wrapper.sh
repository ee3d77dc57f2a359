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
#   4. stops the daemons (SIGTERM) and, unless TIERCKPT_KEEP_TIER=1, removes the job's tier dir,
#      except on a node whose daemon stopped with uploads unfinished (it leaves UPLOADS_PENDING
#      there): that directory is kept, said on stderr, and the wrapper exits 3 if the job had
#      succeeded (a daemon started on it later resumes the uploads; removing it loses the steps).
#
# Environment (optional): TIERCKPT_SHM_DIR (default /dev/shm/tierckpt-$SLURM_JOB_ID, one tier per
# job so that jobs sharing a node do not collide), TIERCKPT_CAPACITY, TIERCKPT_KEEP_LAST, and every
# other TIERCKPT_* daemon setting (srun passes the environment on). TIERCKPT_READY_TIMEOUT
# (seconds, default 120). `tierckpt-daemon` and `tierckpt` must be on PATH on every node (e.g. the
# job's virtual environment on a shared file system).
#
# On one node the daemon has no TCP port (TIERCKPT_PORT=0). On several, the job's daemons form a
# ring, which a save across nodes needs (each rank writes to its own node's daemon, and the
# daemons commit the step together): unless TIERCKPT_PEERS is set, the wrapper sets
# TIERCKPT_PORT (default 20000 + SLURM_JOB_ID % 12000, so that jobs sharing a node differ),
# TIERCKPT_HOST=0.0.0.0, TIERCKPT_PEERS (every node of the job as Slurm names it, with the port),
# each daemon's TIERCKPT_NODE_NAME ($SLURMD_NODENAME:port, whatever the job's environment says),
# and a TIERCKPT_PEER_TOKEN of its own
# for the job (random, unless set). The node names must resolve between the nodes.
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
nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
per_node=(--overlap --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1)
if (( nodes > 1 )) && [[ -z "${TIERCKPT_PEERS:-}" ]]; then
  # Below the kernel's ephemeral range (32768 and up), where an outgoing connection could hold it.
  export TIERCKPT_PORT="${TIERCKPT_PORT:-$((20000 + SLURM_JOB_ID % 12000))}"
  if [[ "$TIERCKPT_PORT" == 0 ]]; then
    echo "tierckpt-srun-wrapper: $nodes nodes need the daemons' TCP port (TIERCKPT_PORT is 0)" >&2
    exit 2
  fi
  export TIERCKPT_HOST="${TIERCKPT_HOST:-0.0.0.0}"
  peers=""
  while read -r host; do
    peers+="${peers:+,}$host:$TIERCKPT_PORT"
  done < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-}")
  if [[ -z "$peers" ]]; then
    echo "tierckpt-srun-wrapper: cannot list the job's $nodes nodes" \
      "(scontrol show hostnames '${SLURM_JOB_NODELIST:-}'); set TIERCKPT_PEERS" >&2
    exit 2
  fi
  export TIERCKPT_PEERS="$peers"
  if [[ -z "${TIERCKPT_PEER_TOKEN:-}" && -z "${TIERCKPT_PEER_TOKEN_FILE:-}" ]]; then
    TIERCKPT_PEER_TOKEN="$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')"
    export TIERCKPT_PEER_TOKEN
  fi
  # shellcheck disable=SC2016  # expanded by each node's shell
  daemon=(bash -c 'TIERCKPT_NODE_NAME="$SLURMD_NODENAME:$TIERCKPT_PORT" exec tierckpt-daemon')
else
  export TIERCKPT_PORT="${TIERCKPT_PORT:-0}"
  daemon=(tierckpt-daemon)
fi

daemon_pid=""
ready_pid=""
cleanup() {
  local rc=$?
  if [[ -n "$ready_pid" ]]; then
    kill "$ready_pid" 2>/dev/null || true
  fi
  if [[ -n "$daemon_pid" ]] && kill -0 "$daemon_pid" 2>/dev/null; then
    # srun forwards SIGTERM to the daemons; they drain their uploads (TIERCKPT_DRAIN_TIMEOUT_S)
    # and exit.
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
  fi
  if [[ "${TIERCKPT_KEEP_TIER:-0}" != 1 ]]; then
    # Free the node memory the job's checkpoints held, unless steps there still wait for their
    # upload: removing the directory would lose them.
    # shellcheck disable=SC2016  # expanded by the remote shell
    if ! srun "${per_node[@]}" bash -c '
        if [[ -e "$1/UPLOADS_PENDING" ]]; then
          echo "tierckpt-srun-wrapper: keeping $1 on $(hostname): uploads to the persistent" \
            "tier did not finish ($(paste -sd " " "$1/UPLOADS_PENDING")); a daemon started on" \
            "it resumes them (TIERCKPT_SHM_DIR=$1); removing it loses those steps" >&2
          exit 3
        fi
        rm -rf -- "$1"' _ "$TIERCKPT_SHM_DIR"; then
      echo "tierckpt-srun-wrapper: the job's tier $TIERCKPT_SHM_DIR was not removed on every" \
        "node (see above)" >&2
      if [[ "$rc" == 0 ]]; then
        rc=3
      fi
    fi
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

srun "${per_node[@]}" --kill-on-bad-exit=1 --job-name=tierckpt-daemon "${daemon[@]}" &
daemon_pid=$!

timeout_s="${TIERCKPT_READY_TIMEOUT:-120}"
# Each node waits for its socket (a file test, cheap), then asks the daemon (`tierckpt status`
# starts a Python process: once a second at most).
# shellcheck disable=SC2016  # expanded by the remote shell
srun "${per_node[@]}" bash -c '
    deadline=$((SECONDS + $1))
    until [[ -S "$TIERCKPT_SOCKET" ]] && tierckpt status >/dev/null 2>&1; do
      if (( SECONDS > deadline )); then
        echo "tierckpt daemon on $(hostname) not ready at $TIERCKPT_SOCKET after $1s" >&2
        exit 1
      fi
      sleep 1
    done' _ "$timeout_s" &
ready_pid=$!
# A daemon that exits (a bad setting: exit 2 at once) fails the wait at once, not at its timeout.
while kill -0 "$ready_pid" 2>/dev/null; do
  if ! kill -0 "$daemon_pid" 2>/dev/null; then
    daemon_rc=0
    wait "$daemon_pid" || daemon_rc=$?
    daemon_pid=""
    echo "tierckpt-srun-wrapper: the daemons exited (status $daemon_rc) before they were ready;" \
      "see the tierckpt-daemon step's output" >&2
    exit 1
  fi
  sleep 0.2
done
ready_rc=0
wait "$ready_pid" || ready_rc=$?
ready_pid=""
if [[ "$ready_rc" != 0 ]]; then
  echo "tierckpt-srun-wrapper: daemons did not start; see the tierckpt-daemon step's output" >&2
  exit 1
fi
echo "tierckpt-srun-wrapper: daemons ready on $nodes node(s), tier $TIERCKPT_SHM_DIR${TIERCKPT_PEERS:+, ring $TIERCKPT_PEERS}" >&2

# The trainers need no peer token (a bearer secret of the daemons): not in their environment.
env -u TIERCKPT_PEER_TOKEN srun "$@"
