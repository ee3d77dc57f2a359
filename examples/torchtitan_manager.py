"""A training loop with torchtitan's parts, checkpointed by ``TieredCheckpointManager``.

torchtitan's ``Trainer`` builds the checkpoint manager from ``config.checkpoint``; this script
builds what the trainer would (an FSDP2 model, torchtitan's ``OptimizersContainer`` and
``LRSchedulersContainer``, the manager) and runs the loop itself, so that it runs on CPU
(torchtitan's trainer imports triton). With the trainer, the one change is the
``--override.imports`` flag of docs/guides/torchtitan.md.

Run on CPU with gloo, next to a running ``tierckpt-daemon``::

    torchrun --nproc-per-node 2 examples/torchtitan_manager.py --namespace demo --steps 20

It saves every step into the node's memory tier (``interval=1``; the last step also goes to the
persistent tier). Kill it and run it again: ``manager.load()`` resumes from the newest step the
daemon committed and the run prints the losses an uninterrupted run prints
(``step <n> loss <float.hex>``). The batches are a function of the step, so a resumed run sees
the batches an uninterrupted one sees.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from tierckpt_client.integrations.torchtitan import TieredCheckpointManager


class TrainState(Stateful):
    """What torchtitan's Trainer saves as ``train_state``: the step to resume after."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--persist-every", type=int, default=None)
    parser.add_argument("--keep-latest-k", type=int, default=3)
    parser.add_argument("--step-time", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    # Odd sizes: FSDP2 shards dim 0 unevenly across 2 ranks.
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # "fused" (torchtitan's default) is CUDA only.
    optimizers = dataclasses.replace(default_adamw(lr=1e-2), implementation="foreach").build(
        model_parts=[model]
    )
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=args.steps
    )
    state = TrainState()

    # What the trainer builds from config.checkpoint (the --override.imports flag sets it).
    manager = TieredCheckpointManager.Config(
        enable=True,
        namespace=args.namespace,
        interval=1,
        keep_latest_k=args.keep_latest_k,
        persist_every=args.persist_every,
        last_save_model_only=False,  # the last step keeps the optimizer: it can be resumed
        initial_load_model_only=False,  # no initial_load_path here (silences its warning)
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder="",  # torchtitan's step folders are not written
    )
    manager.load()  # the newest step in the daemon, if any; restores state.step too
    if rank == 0:
        print(f"start {state.step}", flush=True)

    for step in range(state.step + 1, args.steps + 1):
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        x = torch.randn(8, 16, generator=g)
        loss = (model(x) - x[:, :4]).square().mean()
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step = step
        if rank == 0:
            print(f"step {step} loss {float(loss.detach()).hex()}", flush=True)
        manager.save(step, last_step=step == args.steps)
        time.sleep(args.step_time)  # lets a test stop the run part way

    manager.close()  # waits for the save in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
