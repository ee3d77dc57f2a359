"""A DeepSpeed ZeRO loop whose checkpoints are tierckpt steps (one line: ``install``).

Run on CPU with gloo, next to a running ``tierckpt-daemon``::

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/deepspeed_zero.py \\
        --namespace ds-demo --ckpt /tmp/ds-demo --zero-stage 3 --steps 8 --save-every 4

Run it again with ``--resume``: it loads the tag in ``/tmp/ds-demo/latest`` from tierckpt and
trains on; the losses are those of a run that never stopped, to the last bit. On a node whose
folder is empty (a replacement node, node-local folders), ``restore_folder`` first writes
``latest`` and the tag's pointers from tierckpt's newest step.
"""

from __future__ import annotations

import argparse
import os

import deepspeed
import torch
from torch import nn

from tierckpt_client.integrations.deepspeed import install, restore_folder


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch for this rank: the same in every run."""
    g = torch.Generator().manual_seed(1_000_003 * step + int(os.environ.get("RANK", "0")))
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--namespace", default="ds-demo")
    p.add_argument("--ckpt", default="/tmp/ds-demo", help="folder for `latest` and pointers")
    p.add_argument("--zero-stage", type=int, default=1, choices=[1, 2, 3])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    install(engine, args.namespace)  # the one line: checkpoints go to tierckpt://<namespace>/<N>

    start = 0
    if args.resume:
        restore_folder(args.namespace, args.ckpt)  # an empty folder: `latest` from tierckpt
        path, client = engine.load_checkpoint(args.ckpt)  # the tag in <ckpt>/latest
        assert path is not None, f"no checkpoint in {args.ckpt}"
        start = client["step"]
    if engine.global_rank == 0:
        print(f"start {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item().hex()}", flush=True)
        if step % args.save_every == 0:
            engine.save_checkpoint(args.ckpt, client_state={"step": step})
    engine.destroy()


if __name__ == "__main__":
    main()
