"""A training script that used a ``Checkpointer`` exits with no gloo worker thread left running
into interpreter finalization. One that is (a group's thread letting go of a collective's tensor
after the interpreter stopped) can end the process with SIGABRT ("terminate called without an
active exception") instead of exit code 0: seen in CI after the last save of a loop."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import DaemonProcess, launch_script

pytestmark = pytest.mark.slow

# Registered before anything else, so it runs last among the exit handlers: what is still
# running then runs into finalization.
_SCRIPT = """
import atexit, os, sys

def census():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # the thread ended meanwhile
    print("threads at exit:", " ".join(sorted(names)), flush=True)

atexit.register(census)

import torch
import torch.distributed as dist
from tierckpt_client import Checkpointer

def loop():
    global kept
    model = torch.nn.Linear(64, 64)
    with Checkpointer(os.environ["NS"], every=1) as ckpt:
        ckpt.restore({"model": model})
        for step in range(1, 4):
            ckpt.save(step, {"model": model})
    if os.environ["KEEP"] == "1":
        kept = ckpt  # a script that keeps its Checkpointer in a global

dist.init_process_group("gloo")
loop()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("keep", [False, True], ids=["local", "global"])
def test_no_gloo_thread_outlives_the_exit_handlers(
    keep: bool, daemon: DaemonProcess, tmp_path: Path
) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_SCRIPT)
    env = {**daemon.client_env, "NS": f"exit-{int(keep)}", "KEEP": str(int(keep))}
    procs = launch_script(script, [], 2, env, log_dir=tmp_path / "logs")
    try:
        assert procs[0].stdout is not None
        out = procs[0].stdout.read()
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if procs[0].stdout is not None:
            procs[0].stdout.close()
    logs = (tmp_path / "logs" / "rank1.log").read_text()
    assert codes == [0, 0], f"exit codes {codes}; rank 1's log:\n{logs[-3000:]}"
    line = next((x for x in out.splitlines() if x.startswith("threads at exit:")), None)
    assert line is not None, out
    left = [name for name in line.split()[3:] if "gloo" in name]
    assert not left, f"gloo threads still running at finalization: {left}"
