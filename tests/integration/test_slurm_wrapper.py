"""deploy/slurm/tierckpt-srun-wrapper.sh on one "node": a stand-in ``srun`` that runs its command
here, and the real daemon and CLI. What an operator notices: a daemon that cannot start fails the
job at once (not after TIERCKPT_READY_TIMEOUT), and a tier whose steps still wait for their
upload is kept, said, and the job exits 3 (the cleanup removed it, and the steps with it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import new_shm_dir

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "deploy" / "slurm" / "tierckpt-srun-wrapper.sh"

SAVE = """
import os
from tierckpt_client import DaemonClient
from tierckpt_core.protocol import CommitRequest, SealFile
data = os.urandom(32 << 20)
with DaemonClient() as c:
    lease = c.lease("slurmjob", 0, len(data))
    with open(lease.path, "r+b") as f:
        f.write(data)
    c.seal("slurmjob", 1, "a", 0, [SealFile(lease_id=lease.lease_id, name="d", length=len(data))])
    c.commit("slurmjob", 1, "a", CommitRequest(files=["d"], metadata={}, world_size=1, persist=True))
print("saved")
"""


def _bin(tmp_path: Path) -> Path:
    """``srun`` that drops its options and runs the command here; ``tierckpt-daemon`` and
    ``tierckpt`` as this interpreter runs them (the job's virtual environment on PATH)."""
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    scripts = {
        "srun": '#!/bin/bash\nwhile [[ $# -gt 0 && "$1" == -* ]]; do shift; done\n'
        'export SLURMD_NODENAME="${SLURMD_NODENAME:-n1}"\nexec "$@"\n',
        # The job's nodes, as `scontrol show hostnames $SLURM_JOB_NODELIST` lists them.
        "scontrol": '#!/bin/bash\n[[ "$*" == "show hostnames n[1-2]" ]] && printf "n1\\nn2\\n"\n',
        "tierckpt-daemon": f'#!/bin/bash\nexec {sys.executable} -m tierckpt_daemon "$@"\n',
        "tierckpt": f'#!/bin/bash\nexec {sys.executable} -m tierckpt_client.cli "$@"\n',
    }
    for name, text in scripts.items():
        (b / name).write_text(text)
        (b / name).chmod(0o755)
    return b


def _run(tmp_path: Path, tier: Path, *cmd: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TIERCKPT_")}
    full.update(
        {
            "PATH": f"{_bin(tmp_path)}:{os.environ['PATH']}",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NUM_NODES": "1",
            "TIERCKPT_SHM_DIR": str(tier),
            "TIERCKPT_CAPACITY": "256M",
            **env,
        }
    )
    return subprocess.run(
        ["bash", str(WRAPPER), *cmd], env=full, capture_output=True, text=True, timeout=240
    )


def test_a_daemon_that_cannot_start_fails_the_job_at_once(tmp_path: Path) -> None:
    tier = new_shm_dir()
    t0 = time.monotonic()
    proc = _run(
        tmp_path,
        tier,
        "echo",
        "TRAINING",
        TIERCKPT_READY_TIMEOUT="120",
        TIERCKPT_PERSIST_URL="s3://bucket/x",
        TIERCKPT_S3_ENDPOINT="127.0.0.1:9000",  # no scheme: the daemon exits 2 at once
    )
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr
    assert "TRAINING" not in proc.stdout
    assert "the daemons exited (status 2) before they were ready" in proc.stderr, proc.stderr
    assert "TIERCKPT_S3_ENDPOINT" in proc.stderr
    assert took < 60, f"{took:.0f}s: the wrapper waited for its ready timeout"
    assert not tier.exists()


@pytest.mark.slow
def test_a_tier_whose_uploads_did_not_finish_is_kept_and_said(tmp_path: Path) -> None:
    tier = new_shm_dir()
    persistent = tmp_path / "persistent"
    try:
        proc = _run(
            tmp_path,
            tier,
            sys.executable,
            "-c",
            SAVE,
            TIERCKPT_PERSIST_URL=f"file://{persistent}",
            TIERCKPT_UPLOAD_MAX_RATE="1M",  # 32 MiB: ~24 s past the first burst
            TIERCKPT_DRAIN_TIMEOUT_S="1",
        )
        assert "saved" in proc.stdout, proc.stderr
        assert proc.returncode == 3, proc.stderr
        assert f"keeping {tier}" in proc.stderr and "slurmjob/step 1" in proc.stderr
        assert (tier / "UPLOADS_PENDING").read_text() == "slurmjob/step 1\n"
        # A daemon started on the kept directory resumes the upload, and takes the file away.
        again = _run(
            tmp_path,
            tier,
            "bash",
            "-c",
            "until tierckpt ls slurmjob | grep -q durable; do sleep 0.5; done; echo DURABLE",
            TIERCKPT_PERSIST_URL=f"file://{persistent}",
        )
        assert again.returncode == 0 and "DURABLE" in again.stdout, again.stderr
        assert not tier.exists()  # nothing pending: removed
    finally:
        shutil.rmtree(tier, ignore_errors=True)


def test_a_job_on_several_nodes_gets_a_ring_of_its_daemons(tmp_path: Path) -> None:
    """A save across nodes needs the nodes' daemons to be peers: the wrapper left them without a
    TCP port or peers, so every save of a job on several nodes failed ("the ranks use 2 daemons
    (nodes), which are not peers of each other"). Only node n1 runs here (a stand-in srun)."""
    tier = new_shm_dir()
    show = (
        "tierckpt status --json | python -c 'import json,sys; s=json.load(sys.stdin); "
        'r=s["replication"]; print("NODE", r["node"]); print("PEERS", r["peers"])\''
        ' && echo "TOKEN=${#TIERCKPT_PEER_TOKEN}"'
    )
    proc = _run(
        tmp_path,
        tier,
        "bash",
        "-c",
        show,
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="n[1-2]",
        TIERCKPT_HOST="127.0.0.1",  # (the tests' traffic stays on loopback; the wrapper's: 0.0.0.0)
        TIERCKPT_NODE_NAME="everyone:1",  # one value for every node: ignored
    )
    assert proc.returncode == 0, proc.stderr
    port = 20000 + 4242 % 12000
    assert f"NODE n1:{port}" in proc.stdout, proc.stdout
    assert f"n1:{port}" in proc.stdout and f"n2:{port}" in proc.stdout, proc.stdout
    # A daemon with peers starts only with a token (the wrapper made one for the job): the
    # trainers are not given it.
    assert "TOKEN=0" in proc.stdout
    assert f"ring n1:{port},n2:{port}" in proc.stderr
