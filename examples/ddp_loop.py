"""A plain DDP loop on tierckpt's DCP classes directly (what ``Checkpointer`` does for you).

Run on CPU with gloo, next to a running ``tierckpt-daemon``::

    torchrun --nproc-per-node 2 examples/ddp_loop.py --namespace ddp-demo --steps 20

Kill it and run it again: it resumes from the newest committed step, bit-exact.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from tierckpt_client import NamespaceNotFoundError, StepNotFoundError
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1_000_003 * step + rank))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--namespace", default="ddp-demo")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep per step")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ckpt_group = dist.new_group(backend="gloo")  # checkpoint collectives off the training group
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    # The replicated state (DDP keeps every rank's copy equal) plus the loop's position. The
    # state_dict helpers create the optimizer's momentum entries before the first step, so a
    # restore has somewhere to load them.
    def state() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "step": torch.zeros(())}

    start = 0
    probe = TieredStorageReader(args.namespace, process_group=ckpt_group)
    try:
        probe.read_metadata()  # "latest", decided by rank 0 for all ranks
    except (NamespaceNotFoundError, StepNotFoundError):
        pass  # a fresh start
    else:
        sd = state()
        reader = TieredStorageReader(args.namespace, probe.resolved_step, process_group=ckpt_group)
        dcp.load(sd, storage_reader=reader, process_group=ckpt_group)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = int(sd["step"])
    if rank == 0:
        print(f"start {start}", flush=True)

    pending: Future[Any] | None = None
    for step in range(start + 1, args.steps + 1):
        loss = model(batch(step, rank)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item().hex()}", flush=True)
        time.sleep(args.step_time)
        if step % args.every == 0:
            if pending is not None:
                pending.result()  # one save in flight; its error is raised here
            sd = state()
            sd["step"] = torch.tensor(float(step))
            result = dcp.async_save(
                sd,
                storage_writer=TieredStorageWriter(args.namespace, step),
                process_group=ckpt_group,
            )
            assert isinstance(result, Future)
            pending = result
    if pending is not None:
        pending.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
