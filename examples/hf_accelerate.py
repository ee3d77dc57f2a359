"""An ``accelerate`` training loop (a tiny GPT-2 built from a config, DDP on CPU with gloo)
checkpointed through tierckpt with ``Checkpointer`` and ``TrainingState``.

Run next to a running ``tierckpt-daemon``::

    torchrun --nproc-per-node 2 examples/hf_accelerate.py --namespace acc-demo --steps 8 --every 2

Kill it and run it again: it resumes from the newest step. Rank 0 prints ``start <step>`` and,
after each step, ``step <n> loss <digest of the weights>``; every batch is the same sample and
dropout is off, so a resumed run prints the digests an uninterrupted one prints.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from tierckpt_client import Checkpointer
from tierckpt_client.integrations.hf import TrainingState


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--persist-every", type=int, default=None)
    a = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # accelerate's prepared scheduler steps once per process at each optimizer step: its counts
    # are in those (else the rate reached 0 half-way on 2 processes, and later steps changed
    # nothing, which a resume check could not tell from a broken restore).
    n = accelerator.num_processes
    sched = get_linear_schedule_with_warmup(
        opt, num_warmup_steps=2 * n, num_training_steps=a.steps * n
    )
    model, opt, sched = accelerator.prepare(model, opt, sched)
    batch = (torch.arange(16) % 50).repeat(4, 1)

    # The one addition to an accelerate loop: the state, a Checkpointer, restore and save.
    state = {"train": TrainingState(model, opt, sched)}
    with Checkpointer(a.namespace, every=a.every, persist_every=a.persist_every) as ckpt:
        start = ckpt.restore(state) or 0
        if accelerator.is_main_process:
            print(f"start {start}", flush=True)
        for step in range(start + 1, a.steps + 1):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            if accelerator.is_main_process:
                print(f"step {step} loss {digest(accelerator.unwrap_model(model))}", flush=True)
            ckpt.save(step, state)
    accelerator.end_training()


if __name__ == "__main__":
    main()
