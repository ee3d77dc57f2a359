"""The examples in examples/, run as a user runs them: 2 gloo ranks on CPU next to a real daemon,
killed after a few steps, run again: the resumed run prints the losses an uninterrupted run prints,
bit for bit (losses are printed as float.hex)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import DaemonProcess, LoopRun, run_loop

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def assert_resumed(ref: LoopRun, killed: LoopRun, resumed: LoopRun, steps: int) -> None:
    """``resumed`` restarted from a step ``killed`` saved, and every loss it printed equals the
    uninterrupted run's for that step (``ref``; or ``killed`` itself for the steps it got to)."""
    assert killed.returncodes[0] != 0, "the first run was not killed"
    assert resumed.returncodes == [0, 0], resumed.lines
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
    from helpers import new_shm_dir

    d = DaemonProcess(new_shm_dir()).start()
    try:
        ref = run_loop(
            EXAMPLES / "fsdp2_checkpointer.py",
            ["--namespace", "ref", "--steps", "8"],
            d.client_env,
            log_dir=tmp_path_factory.mktemp("ref"),
        )
    finally:
        d.cleanup()
    assert ref.returncodes == [0, 0] and sorted(ref.losses) == list(range(1, 9)), ref.lines
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
    fsdp2_reference: LoopRun, tmp_path: Path
) -> None:
    """SIGTERM to one rank: all ranks save that step, it becomes durable in the persistent tier,
    both exit 0 within the deadline; the node then loses its memory, and the restart resumes from
    the persistent tier at exactly that step."""
    import shutil
    import signal
    import time

    from tierckpt_client import DaemonClient
    from tierckpt_client.config import ClientConfig

    from helpers import new_shm_dir

    store = tmp_path / "store"
    node = DaemonProcess(new_shm_dir(), persist_url=f"file://{store}").start()
    script = EXAMPLES / "fsdp2_checkpointer.py"
    # Regular steps stay in memory: only the preemption asks for the persistent tier.
    args = ["--namespace", "job", "--steps", "8", "--persist-every", "1000"]
    try:
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
        assert stopped.returncodes == [0, 0], stopped.lines
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
    finally:
        node.cleanup()
    assert resumed.returncodes == [0, 0], resumed.lines
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
