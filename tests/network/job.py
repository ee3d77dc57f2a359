"""A real training job on a :class:`cluster.Cluster`: one rank of ``_net_trainer.py`` per node,
each in its node's namespace, driven line by line (see that script)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

from cluster import NS, Cluster, Save

_SCRIPT = Path(__file__).with_name("_net_trainer.py")


class Job:
    def __init__(self, c: Cluster, work: Path) -> None:
        self.c = c
        self.logs = work / "ranks"
        self.logs.mkdir(parents=True, exist_ok=True)
        store = work / "store"
        n = len(c.nodes)
        self.procs: list[subprocess.Popen[str]] = []
        for rank, d in enumerate(c.nodes):
            env = {
                **os.environ,
                **d.client_env,
                "RANK": str(rank),
                "WORLD_SIZE": str(n),
                "NET_STORE": str(store),
                "GLOO_SOCKET_IFNAME": "eth0",
                "PYTHONUNBUFFERED": "1",
            }
            with open(self.logs / f"rank{rank}.log", "ab") as err:
                self.procs.append(
                    subprocess.Popen(
                        [*c.lab.exec(rank), sys.executable, str(_SCRIPT), NS],
                        env=env,
                        stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                        stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                        stderr=err,
                        text=True,
                    )
                )

    def ask(self, cmd: str, timeout: float = 120.0) -> str:
        """Send rank 0 a command; its answer line (fails with the ranks' logs if none comes)."""
        p = self.procs[0]
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(cmd + "\n")
        p.stdin.flush()
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline().strip() if ready else ""
        assert line, f"no answer to {cmd!r} within {timeout:g}s: {self.describe()}"
        return line

    def save(self, step: int) -> Save:
        """A save through DCP on every rank; recorded in the cluster like its own saves."""
        verb, _, rest = self.ask(f"save {step}").partition(" ")
        _, seconds, error = [*rest.split(" ", 2), ""][:3]
        s = Save(step, f"job-{step}", {}, verb == "saved", error or None, float(seconds))
        self.c.saves[step] = s
        return s

    def describe(self) -> str:
        codes = [p.poll() for p in self.procs]
        logs = "".join(
            f"\n--- {f.name} ---\n{f.read_text(errors='replace')[-3000:]}"
            for f in sorted(self.logs.glob("rank*.log"))
        )
        return f"exit codes {codes}{logs}"

    def close(self) -> None:
        p = self.procs[0]
        if p.poll() is None and p.stdin is not None:
            try:
                p.stdin.write("quit\n")
                p.stdin.flush()
            except OSError:
                pass
        deadline = time.monotonic() + 30
        for q in self.procs:
            try:
                q.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                q.kill()
                q.wait(10)
            for f in (q.stdin, q.stdout):
                if f is not None:
                    f.close()
