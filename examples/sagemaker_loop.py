"""The training loop of the SageMaker managed tiered checkpointing setup page, on tierckpt.

Only the import line changed (see docs/migration.md). Before::

    from amzn_sagemaker_checkpointing.config.sagemaker_checkpoint_config import SageMakerCheckpointConfig
    from amzn_sagemaker_checkpointing.checkpointing.filesystem.filesystem import (
        SageMakerTieredStorageReader,
        SageMakerTieredStorageWriter,
    )

Checkpoints go to memory every ``CKPT_EVERY`` steps (10 in the docs) and also to S3 every
``S3_EVERY`` steps (50): ``save_to_s3`` is flipped per step. Run next to a ``tierckpt-daemon``
whose ``TIERCKPT_PERSIST_URL`` is the bucket::

    CHECKPOINT_S3_PATH=s3://bucket/checkpoints torchrun --nproc-per-node 2 examples/sagemaker_loop.py

The training step here is a stand-in without collectives (each rank trains the same replica on the
same data). With DDP or FSDP, give ``async_save`` and ``load`` a gloo group of their own
(``process_group=``): a background save's collectives must not share the training group.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import async_save, load
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tierckpt_client import NamespaceNotFoundError, StepNotFoundError
from tierckpt_client.compat.sagemaker import (
    SageMakerCheckpointConfig,
    SageMakerTieredStorageReader,
    SageMakerTieredStorageWriter,
)

CKPT_EVERY = int(os.environ.get("CKPT_EVERY", "10"))
S3_EVERY = int(os.environ.get("S3_EVERY", "50"))
TOTAL_STEPS = int(os.environ.get("TOTAL_STEPS", "200"))
STEP_TIME = float(os.environ.get("STEP_TIME", "0"))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    checkpoint_config = SageMakerCheckpointConfig(
        namespace=os.environ.get("TRAINING_JOB_NAME", "sagemaker-demo"),
        world_size=dist.get_world_size(),
        s3_tier_base_path=os.environ.get("CHECKPOINT_S3_PATH"),
        save_to_s3=False,
    )

    # Resume from the latest checkpoint, if there is one.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state_dict = {"model": model_sd, "optimizer": optim_sd, "step": 0}
    start_step = 0
    reader = SageMakerTieredStorageReader(checkpoint_config=checkpoint_config)
    try:
        reader.resolve()  # the newest step that verifies, the same on every rank
    except (NamespaceNotFoundError, StepNotFoundError) as e:  # a first start
        if rank == 0:
            print(f"no checkpoint to resume from ({e})", flush=True)
    else:  # anything else (the tiers unreachable, every step damaged) fails the job, loudly
        load(state_dict, storage_reader=reader)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )
        start_step = int(state_dict["step"])
    if rank == 0:
        print(f"start {start_step}", flush=True)

    future = None
    for step in range(start_step + 1, TOTAL_STEPS + 1):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item().hex()}", flush=True)
        time.sleep(STEP_TIME)

        if step % CKPT_EVERY == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state_dict = {"model": model_sd, "optimizer": optim_sd, "step": step}
            checkpoint_config.save_to_s3 = step % S3_EVERY == 0
            if future is not None:
                future.result()  # wait for the previous checkpoint before the next
            future = async_save(
                state_dict,
                storage_writer=SageMakerTieredStorageWriter(
                    checkpoint_config=checkpoint_config, step=step
                ),
            )
    if future is not None:
        future.result()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
