"""A PyTorch Lightning run checkpointed through tierckpt: one line differs from plain Lightning
(the strategy for FSDP2, a plugin for DDP).

Run on CPU with gloo, next to a running ``tierckpt-daemon``::

    torchrun --nproc-per-node 2 examples/lightning_trainer.py --namespace demo --steps 20
    torchrun --nproc-per-node 2 examples/lightning_trainer.py --namespace demo-ddp --strategy ddp

It saves every step (``ModelCheckpoint(every_n_train_steps=1, save_last=True)``): the step goes to
the node's memory tier, and a one-line pointer file per checkpoint to ``--dirpath``. Kill it and
run it again: ``trainer.fit(..., ckpt_path="last")`` resumes from the newest step the daemon holds
and prints the losses an uninterrupted run prints (``step <n> loss <float.hex>``).
Send SIGTERM to every rank (as torchrun, Slurm and Kubernetes do): with FSDP2 the step it stops
at is saved for the persistent tier and waited for until durable, and the run exits 0.

The batches are a function of the step, so that resuming mid-epoch sees the batches an
uninterrupted run sees; with a real dataset, use a stateful data loader for that.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from tierckpt_client.integrations.lightning import TieredCheckpointIO, TieredModelParallelStrategy


class Net(L.LightningModule):
    def __init__(self, step_time: float, fsdp2: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Odd sizes: FSDP2 shards dim 0 unevenly across 2 ranks.
        self.net = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
        self.step_time = step_time
        self.fsdp2 = fsdp2

    def configure_model(self) -> None:
        if not self.fsdp2:
            return  # DDP wraps the model itself
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_train_start(self) -> None:
        if self.global_rank == 0:
            print(f"start {self.global_step}", flush=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.global_step + 1  # the step this batch makes
        g = torch.Generator().manual_seed(1_000_003 * step + self.global_rank)
        x = torch.randn(8, 16, generator=g)
        loss = (self.net(x) - x[:, :4]).square().mean()
        if self.global_rank == 0:
            print(f"step {step} loss {float(loss.detach()).hex()}", flush=True)
        time.sleep(self.step_time)  # lets a test stop the run part way
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dirpath", default="lightning-checkpoints")
    parser.add_argument("--persist-every", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--strategy", choices=["fsdp2", "ddp"], default="fsdp2")
    parser.add_argument(
        "--ckpt-path", default="last", help='"last", or a step: tierckpt://<namespace>/<step>'
    )
    args = parser.parse_args()

    # The one line that differs from plain Lightning, for each kind of strategy.
    if args.strategy == "fsdp2":
        strategy: Any = TieredModelParallelStrategy(
            args.namespace,
            persist_every=args.persist_every,
            data_parallel_size=2,
            tensor_parallel_size=1,
        )
        plugins = []
    else:
        strategy = "ddp"
        plugins = [TieredCheckpointIO(args.namespace, persist_every=args.persist_every)]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=plugins,
        max_steps=args.steps,
        callbacks=[
            ModelCheckpoint(
                dirpath=args.dirpath,
                every_n_train_steps=1,
                save_last=True,
                # Keeps the newest k steps; the others are deleted from the daemon.
                save_top_k=args.top_k,
                monitor="step" if args.top_k > 1 else None,
                mode="max",
            )
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # The batches' content is made in training_step; the loader only sets the epoch's length.
    data = DataLoader(list(range(4 * args.steps)), batch_size=1)
    trainer.fit(Net(args.step_time, args.strategy == "fsdp2"), data, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
