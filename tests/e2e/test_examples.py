"""The examples in examples/, run as a user runs them: 2 gloo ranks on CPU next to a real daemon,
killed after a few steps, run again: the resumed run prints the losses an uninterrupted run prints,
bit for bit (losses are printed as float.hex)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from seaweed import SeaweedS3

from helpers import DaemonProcess, LoopRun, run_loop, started

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def assert_resumed(ref: LoopRun, killed: LoopRun, resumed: LoopRun, steps: int) -> None:
    """``resumed`` restarted from a step ``killed`` saved, and every loss it printed equals the
    uninterrupted run's for that step (``ref``; or ``killed`` itself for the steps it got to)."""
    assert killed.returncodes[0] != 0, "the first run was not killed"
    assert resumed.returncodes == [0, 0], resumed
    assert resumed.start is not None and resumed.start >= 1, resumed.lines
    assert resumed.start < max(killed.losses), "nothing to compare: resumed past the kill"
    assert sorted(resumed.losses) == list(range(resumed.start + 1, steps + 1))
    for step, loss in resumed.losses.items():
        expected = ref.losses.get(step, killed.losses.get(step))
        if expected is not None:
            assert loss == expected, f"step {step}: {loss} != {expected}"


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory: pytest.TempPathFactory) -> LoopRun:
    """An uninterrupted FSDP2 run (its own daemon, so no test's namespaces interfere)."""
    with started() as d:
        ref = run_loop(
            EXAMPLES / "fsdp2_checkpointer.py",
            ["--namespace", "ref", "--steps", "8"],
            d.client_env,
            log_dir=tmp_path_factory.mktemp("ref"),
        )
    assert ref.returncodes == [0, 0] and sorted(ref.losses) == list(range(1, 9)), ref
    return ref


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_fsdp2_checkpointer_resumes_bit_exact(
    mode: str, fsdp2_reference: LoopRun, daemon: DaemonProcess, tmp_path: Path
) -> None:
    script = EXAMPLES / "fsdp2_checkpointer.py"
    args = ["--namespace", "job", "--steps", "8", "--async-mode", mode]
    killed = run_loop(
        script, [*args, "--step-time", "0.5"], daemon.client_env, log_dir=tmp_path, stop_after=4
    )
    assert killed.start == 0
    resumed = run_loop(script, args, daemon.client_env, log_dir=tmp_path)
    assert_resumed(fsdp2_reference, killed, resumed, 8)


def test_sigterm_saves_a_durable_step_exits_0_and_resumes(
    fsdp2_reference: LoopRun, tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """SIGTERM to one rank: all ranks save that step, it becomes durable in the persistent tier,
    both exit 0 within the deadline; the node then loses its memory, and the restart resumes from
    the persistent tier at exactly that step."""
    import shutil
    import signal
    import time

    from tierckpt_client import DaemonClient
    from tierckpt_client.config import ClientConfig

    store = tmp_path / "store"
    node = make_node(persist_url=f"file://{store}")
    script = EXAMPLES / "fsdp2_checkpointer.py"
    # Regular steps stay in memory: only the preemption asks for the persistent tier.
    args = ["--namespace", "job", "--steps", "8", "--persist-every", "1000"]
    t0 = time.monotonic()
    stopped = run_loop(
        script,
        [*args, "--step-time", "0.5", "--preempt-deadline", "60"],
        node.client_env,
        log_dir=tmp_path,
        stop_after=3,
        stop_signal=signal.SIGTERM,
        signal_ranks=[1],
    )
    assert stopped.returncodes == [0, 0], stopped
    assert time.monotonic() - t0 < 60 + 30
    final = max(stopped.losses)
    assert final < 8, "the run was not preempted"
    with DaemonClient(ClientConfig.from_env(socket=node.socket)) as c:
        states = {s.step: s.state.value for s in c.steps("job")}
    assert states[final] == "durable", states
    assert all(v != "durable" for k, v in states.items() if k != final), states
    assert (store / "job" / f"step_{final:012d}").is_dir()

    node.kill()
    shutil.rmtree(node.shm_dir)  # the node lost its memory: only the persistent tier is left
    node.start()
    resumed = run_loop(script, args, node.client_env, log_dir=tmp_path)
    assert resumed.returncodes == [0, 0], resumed
    assert resumed.start == final
    assert sorted(resumed.losses) == list(range(final + 1, 9))
    for step, loss in resumed.losses.items():
        assert loss == fsdp2_reference.losses[step], step


MEMORY_ONLY_WARNING = (
    "the final save is in node memory (and on its replicas, if any) only, because no "
    "persistent tier is configured"
)


def test_sigterm_without_a_persistent_tier_saves_to_memory_exits_0_and_resumes(
    fsdp2_reference: LoopRun, tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """A daemon with no persistent tier: SIGTERM to one rank, every rank saves that step into
    the node's memory, and both exit 0 with one warning (for the job, not per rank) that the save
    is only there; a restart on the same node resumes from exactly that step."""
    import signal

    from tierckpt_client import DaemonClient
    from tierckpt_client.config import ClientConfig

    node = make_node()  # no TIERCKPT_PERSIST_URL
    script = EXAMPLES / "fsdp2_checkpointer.py"
    args = ["--namespace", "job", "--steps", "8"]
    stopped = run_loop(
        script,
        [*args, "--step-time", "0.5", "--preempt-deadline", "60"],
        node.client_env,
        log_dir=tmp_path / "stopped",
        stop_after=3,
        stop_signal=signal.SIGTERM,
        signal_ranks=[1],
    )
    logs = "".join(p.read_text() for p in sorted((tmp_path / "stopped").glob("rank*.log")))
    assert stopped.returncodes == [0, 0], (stopped.lines, logs)
    final = max(stopped.losses)
    assert final < 8, "the run was not preempted"
    assert logs.count(MEMORY_ONLY_WARNING) == 1, logs
    assert f"preempted at step {final}: " in logs, logs
    assert "Traceback" not in logs, logs
    with DaemonClient(ClientConfig.from_env(socket=node.socket)) as c:
        assert c.step("job", final).state.value == "committed"

    resumed = run_loop(script, args, node.client_env, log_dir=tmp_path / "resumed")
    assert resumed.returncodes == [0, 0], resumed
    assert resumed.start == final
    assert sorted(resumed.losses) == list(range(final + 1, 9))
    for step, loss in resumed.losses.items():
        assert loss == fsdp2_reference.losses[step], step


def test_ddp_loop_resumes_bit_exact(daemon: DaemonProcess, tmp_path: Path) -> None:
    script = EXAMPLES / "ddp_loop.py"
    args = ["--namespace", "ddp", "--steps", "7"]
    killed = run_loop(
        script, [*args, "--step-time", "0.5"], daemon.client_env, log_dir=tmp_path, stop_after=4
    )
    resumed = run_loop(script, args, daemon.client_env, log_dir=tmp_path)
    # The steps both runs printed compare the resumed run with an uninterrupted one.
    assert_resumed(killed, killed, resumed, 7)


def test_sagemaker_loop_resumes_and_save_to_s3_steps_are_durable(
    s3_env: SeaweedS3, tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    """The AWS docs loop with only its import line changed: saves every 2 steps, save_to_s3
    every 4; killed after step 6 and run again, it resumes bit-exact, and exactly the
    save_to_s3 steps are durable in a real S3 server."""
    import time

    from tierckpt_client import DaemonClient
    from tierckpt_client.config import ClientConfig

    url = f"s3://{s3_env.bucket}/sagemaker-loop"
    node = make_node(persist_url=url)
    env = {
        **node.client_env,
        "CHECKPOINT_S3_PATH": url,
        "TRAINING_JOB_NAME": "sm-job",
        "CKPT_EVERY": "2",
        "S3_EVERY": "4",
        "TOTAL_STEPS": "9",
    }
    script = EXAMPLES / "sagemaker_loop.py"
    killed = run_loop(script, [], {**env, "STEP_TIME": "0.5"}, log_dir=tmp_path, stop_after=6)
    # A first start says so, once, without the two tracebacks DCP's load printed for it.
    assert any(line.startswith("no checkpoint to resume from (") for line in killed.lines)
    first = (tmp_path / "rank0.log").read_text()
    assert "Traceback" not in first, first[-3000:]
    resumed = run_loop(script, [], env, log_dir=tmp_path)
    assert_resumed(killed, killed, resumed, 9)
    deadline = time.monotonic() + 60
    with DaemonClient(ClientConfig.from_env(socket=node.socket)) as c:
        while True:
            states = {s.step: s.state.value for s in c.steps("sm-job")}
            if states.get(8) == "durable" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert states[8] == "durable" and states[6] == "committed", states
    s3 = s3_env.boto3_client()
    try:
        listed = s3.list_objects_v2(Bucket=s3_env.bucket, Prefix="sagemaker-loop/sm-job/")
    finally:
        s3.close()
    steps = {k["Key"].split("/")[2] for k in listed.get("Contents", [])}
    assert "step_000000000008" in steps and "step_000000000004" in steps, steps
    assert not steps & {"step_000000000002", "step_000000000006"}, steps


def test_slurm_sbatch_parses_and_names_the_example_options() -> None:
    """No Slurm here: check the script parses and passes only options the example has."""
    import re
    import subprocess

    script = EXAMPLES / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    used = set(re.findall(r"(--[a-z-]+)", script.read_text().split("fsdp2_checkpointer.py")[1]))
    known = set(
        re.findall(r'add_argument\("(--[a-z-]+)"', (EXAMPLES / "fsdp2_checkpointer.py").read_text())
    )
    assert used <= known, used - known
