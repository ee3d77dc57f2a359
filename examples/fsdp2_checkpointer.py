"""FSDP2 training loop checkpointed every step with ``tierckpt_client.Checkpointer``.

Run on CPU with gloo (next to a running ``tierckpt-daemon``)::

    torchrun --nproc-per-node 2 examples/fsdp2_checkpointer.py --namespace demo --steps 20

Kill it and run it again: it resumes from the newest checkpoint and prints the same losses an
uninterrupted run prints. Send SIGTERM (or ``--preempt-signal USR1`` and SIGUSR1) to any rank:
all ranks save that step, wait until it is durable in the persistent tier, and exit 0.

What is checkpointed: the sharded model and optimizer (through
``torch.distributed.checkpoint.state_dict``), the data position, and each rank's RNG state (the
dropout masks depend on it).
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tierckpt_client import Checkpointer


class Batches:
    """A deterministic synthetic data stream whose position is its state."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.position = 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 * self.position + self.rank)
        self.position += 1
        return torch.randn(8, 16, generator=g)


class TrainState(Stateful):
    """Everything a resumed run needs to continue bit-exact."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, data: Batches) -> None:
        self.model, self.opt, self.data = model, opt, data
        self.rng_key = f"rng_rank{dist.get_rank()}"  # per rank: each rank's masks differ

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {
            "model": model_sd,
            "optim": optim_sd,
            f"data_rank{self.data.rank}": {"position": self.data.position},
            self.rng_key: torch.get_rng_state(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.data.position = sd[f"data_rank{self.data.rank}"]["position"]
        torch.set_rng_state(sd[self.rng_key])


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--namespace", default="fsdp2-demo")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--persist-every", type=int, default=None)
    p.add_argument("--async-mode", choices=["thread", "process"], default="thread")
    p.add_argument("--preempt-signal", default=None, help="e.g. USR1 (SIGTERM is always handled)")
    p.add_argument("--preempt-deadline", type=float, default=300.0, help="seconds to durable")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds to sleep per step")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = build()
    torch.manual_seed(1 + rank)  # each rank's dropout stream
    state = TrainState(model, opt, Batches(rank))
    extra = getattr(signal, f"SIG{args.preempt_signal}") if args.preempt_signal else None

    with Checkpointer(
        args.namespace,
        every=args.every,
        persist_every=args.persist_every,
        async_mode=args.async_mode,
        preempt_signal=extra,
        preempt_deadline_s=args.preempt_deadline,
    ) as ckpt:
        start = ckpt.restore({"train": state}) or 0
        if rank == 0:
            print(f"start {start}", flush=True)
        for step in range(start + 1, args.steps + 1):
            loss = model(state.data.next()).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if rank == 0:
                print(f"step {step} loss {loss.item().hex()}", flush=True)
            time.sleep(args.step_time)
            ckpt.save(step, {"train": state})
    dist.destroy_process_group()


if __name__ == "__main__":  # PROCESS-mode saves re-import this file in a helper process
    main()
