"""Demo: a 2-rank FSDP2 training loop checkpoints through a tierckpt daemon, loses its node, resumes.

Run ``python -m tierckpt_client.demo``. If no daemon answers on ``TIERCKPT_SOCKET``, the demo starts
an embedded one on a private tmpfs directory with the embedded default persistent tier, a
``file://`` directory (no S3 needed), and removes both at the end. It then:

1. trains steps 1..23, ``async_save`` every 5 steps (memory tier, uploaded in the background);
2. "crashes" after step 23, and the node is lost: the daemon stops and its memory is wiped;
3. a replacement daemon starts with empty memory, the job restarts and resumes from the newest
   durable step (20), hydrated from the persistent tier with every checksum verified, and trains on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

NAMESPACE = "demo-job"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(sock: str) -> bool:
    from tierckpt_client import DaemonClient, DaemonUnavailableError

    with DaemonClient.from_socket(sock, connect_timeout_s=1.0) as c:
        try:
            c.status()
        except DaemonUnavailableError:
            return False
    return True


class _EmbeddedDaemon:
    """A daemon of our own: private tmpfs tier, ``file://`` persistent tier, no TCP port."""

    def __init__(self) -> None:
        from tierckpt_daemon.launcher import DaemonProcess

        self.shm_dir = Path(tempfile.mkdtemp(prefix="tierckpt-demo-", dir="/dev/shm"))
        self.store = Path(tempfile.mkdtemp(prefix="tierckpt-demo-store-"))
        self.socket = str(self.shm_dir / "daemon.sock")
        self.daemon = DaemonProcess(
            self.shm_dir,
            log_path=self.store.parent / f"{self.store.name}.log",
            port=0,
            capacity="1G",
            persist_url=f"file://{self.store}",
            log_level="WARNING",
        )

    def start(self) -> None:
        self.daemon.start()

    def lose_node(self) -> None:
        """Stop the daemon and wipe its memory tier, as a node replacement would."""
        self.daemon.stop()  # SIGTERM: queued uploads drain first
        self.daemon.lose_node()
        self.daemon.start()

    def cleanup(self) -> None:
        self.daemon.cleanup()
        shutil.rmtree(self.store, ignore_errors=True)


def _rank(rank: int, world: int, port: int, sock: str, first: int, last: int, crash: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TIERCKPT_SOCKET=sock)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ckpt_group = dist.new_group(backend="gloo")  # checkpoint collectives off the training group
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = first
    if first > 0:  # a restarted job: resume from the newest committed step
        msd, osd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": msd, "optim": osd, "train": {"step": -1}}
        reader = TieredStorageReader(NAMESPACE, process_group=ckpt_group)
        dcp.load(state, storage_reader=reader, process_group=ckpt_group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["train"]["step"]
        if rank == 0:
            print(f"[rank 0] resumed from step {reader.resolved_step} of {NAMESPACE}")
    gen = torch.Generator().manual_seed(1000 * rank + step)
    pending: Future[Any] | None = None
    while step < last:
        x = torch.randn(32, 64, generator=gen)
        loss = (model(x) - x.flip(1)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % 5 == 0:
            if pending is not None:
                pending.result()
            msd, osd = get_state_dict(model, opt)
            t0 = time.perf_counter()
            response = dcp.async_save(
                {"model": msd, "optim": osd, "train": {"step": step}},
                storage_writer=TieredStorageWriter(NAMESPACE, step),
                process_group=ckpt_group,
            )
            # A Future, since the writer stages synchronously (an async stager gets a response).
            assert isinstance(response, Future)
            pending = response
            stall_ms = (time.perf_counter() - t0) * 1e3
            if rank == 0:
                print(
                    f"[rank 0] step {step:3d} loss {loss.item():.4f} checkpoint stall {stall_ms:.1f} ms"
                )
        if crash and step == last:
            if pending is not None:
                pending.result()
            if rank == 0:
                print(f"[rank 0] simulating a crash after step {step}")
            os._exit(0)
    if pending is not None:
        pending.result()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crash-at", type=int, default=23, help="step after which the first run dies")
    p.add_argument("--steps", type=int, default=40, help="last training step")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    from tierckpt_client import ClientConfig, DaemonClient

    sock = str(ClientConfig.from_env().socket)
    embedded = None
    if _answers(sock):
        print(f"using the running daemon at {sock}")
    else:
        embedded = _EmbeddedDaemon()
        embedded.start()
        sock = embedded.socket
        print(
            f"started an embedded daemon: memory tier {embedded.shm_dir}, persistent tier "
            f"file://{embedded.store}"
        )
    try:
        print(f"--- run 1: train steps 1..{args.crash_at}, async_save every 5 steps, then crash")
        ctx = mp.start_processes(
            _rank,
            args=(2, _free_port(), sock, 0, args.crash_at, True),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        while not ctx.join():
            pass
        if embedded is not None:
            print("--- the node is lost: the daemon stops (draining uploads), its memory is wiped")
            embedded.lose_node()
        print(f"--- run 2: a replacement job resumes and trains to step {args.steps}")
        mp.spawn(_rank, args=(2, _free_port(), sock, 1, args.steps, False), nprocs=2)
        with DaemonClient.from_socket(sock) as c:
            steps = c.steps(NAMESPACE)
            if embedded is not None:
                deadline = time.monotonic() + 60  # let the last upload finish for the listing
                while c.status().persistent.queued_steps and time.monotonic() < deadline:  # type: ignore[union-attr]
                    time.sleep(0.1)
                steps = c.steps(NAMESPACE)
        print("--- steps held in memory by the daemon (durable = also in the persistent tier):")
        for s in steps:
            print(
                f"  step {s.step:4d}  {s.state.value:9s}  {s.bytes / 1e6:6.2f} MB  {len(s.files)} files"
            )
        if embedded is not None:
            stored = sorted({p.parent.name for p in embedded.store.rglob("COMMITTED")})
            print(f"--- durable in file://{embedded.store}: {', '.join(stored)}")
        if steps[-1].step != args.steps - args.steps % 5:
            print("unexpected: the newest step is not the last one saved", file=sys.stderr)
            return 1
    finally:
        if embedded is not None:
            embedded.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
