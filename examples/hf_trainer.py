"""A ``transformers.Trainer`` run (a tiny GPT-2 built from a config, DDP on CPU with gloo)
checkpointed through tierckpt with :class:`TieredCheckpointCallback`.

Run next to a running ``tierckpt-daemon``::

    torchrun --nproc-per-node 2 examples/hf_trainer.py --namespace hf-demo --steps 8 --every 2

Kill it and run it again: it resumes from the newest step. Rank 0 prints ``start <step>`` and,
after each optimizer step, ``step <n> loss <digest of the weights>``. Every batch is the same
sample and dropout is off, so a resumed run prints the digests an uninterrupted one prints
(the Trainer restarts its data loader from the beginning of the epoch on resume).
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from tierckpt_client.integrations.hf import TieredCheckpointCallback


class Repeated(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """One fixed sample, ``n`` times: the data position does not change what a step computes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ids = torch.arange(16) % 50

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids, "labels": self.ids}


class PrintDigests(TrainerCallback):
    def __init__(self, tiered: TieredCheckpointCallback) -> None:
        self.tiered = tiered

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            print(f"start {self.tiered.restored_step or 0}", flush=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            h = hashlib.sha256()
            for name, p in sorted(kwargs["model"].state_dict().items()):
                h.update(name.encode())
                h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            print(f"step {state.global_step} loss {h.hexdigest()[:16]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--persist-every", type=int, default=None)
    a = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    tiered = TieredCheckpointCallback(a.namespace, every=a.every, persist_every=a.persist_every)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=a.steps,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            warmup_steps=2,
            use_cpu=True,
            ddp_backend="gloo",
            ddp_find_unused_parameters=False,
            save_strategy="no",  # the callback checkpoints; no files in output_dir
            report_to=[],
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=Repeated(4 * 64),
            callbacks=[tiered, PrintDigests(tiered)],
        )
        trainer.train()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
