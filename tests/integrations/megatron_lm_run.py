"""Megatron-LM's own save_checkpoint/load_checkpoint with tierckpt installed (CPU, gloo): run by
tests/integrations/test_megatron_lm.py on 2 ranks, a daemon on the node.

A tiny GPTModel (local spec, CPU initialization, TP=--tp): step 1 saved sync, step 2 with
``--async-save`` (weights changed right after save_checkpoint returned), then the tracker is made
to name step 5 (which the test sealed but never committed) and a fresh model is loaded with
load_checkpoint: "latest" must be step 2, bit-exact; then step 1 (``--ckpt-step``), bit-exact.
Rank 0 prints one JSON line.

CPU shims (this script's, not the integration's): Megatron-LM's checkpoint stores
``torch.cuda.get_rng_state()`` and a load restores it with ``torch.cuda.set_rng_state``; without
a GPU both are replaced by no-ops, and ``--no-load-rng`` is set (Megatron's CUDA RNG tracker has
no states without a GPU, and Megatron-LM exits on loading an empty one). Megatron-LM's global args come from its own ``parse_args``
(no ``validate_args``: it wants a full training setup), with the few fields it derives set here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if not torch.cuda.is_available():  # the CPU shims (see the docstring)
    torch.cuda.get_rng_state = lambda device="cuda": torch.zeros(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.transformer import TransformerConfig
from megatron.training import async_utils, checkpointing
from megatron.training.arguments import parse_args
from megatron.training.global_vars import set_args

from tierckpt_client.integrations import megatron_lm


def build(seed: int) -> GPTModel:
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
    )
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


def trained(model: GPTModel, step: int) -> GPTModel:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(step)
    return model


def megatron_args(folder: str, tp: int) -> argparse.Namespace:
    sys.argv = [sys.argv[0], "--num-layers", "2", "--hidden-size", "32"]
    sys.argv += ["--num-attention-heads", "4", "--seq-length", "16"]
    sys.argv += ["--max-position-embeddings", "16", "--micro-batch-size", "1"]
    sys.argv += ["--tensor-model-parallel-size", str(tp), "--save", folder, "--load", folder]
    sys.argv += ["--ckpt-format", "torch_dist", "--no-save-optim", "--no-load-optim"]
    sys.argv += ["--no-load-rng"]  # the CUDA RNG tracker is empty without a GPU: nothing to load
    args = parse_args()
    # What validate_args derives, for this setup.
    args.data_parallel_size = args.world_size // tp
    args.use_dist_ckpt = True
    args.global_batch_size = args.data_parallel_size
    set_args(args)
    init_num_microbatches_calculator(
        args.rank, None, args.global_batch_size, 1, args.world_size // tp
    )
    return args


def exact(model: GPTModel, step: int) -> bool:
    want = trained(build(seed=1), step).state_dict()
    got = model.state_dict()
    ok = all(torch.equal(got[k], v) for k, v in want.items() if isinstance(v, torch.Tensor))
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return all(flags)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--namespace", required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--tp", type=int, default=2)
    ours = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=ours.tp)
    args = megatron_args(ours.folder, ours.tp)
    tracker = Path(checkpointing.get_checkpoint_tracker_filename(ours.folder))
    out: dict[str, object] = {}
    with megatron_lm.install(ours.namespace):
        model = trained(build(seed=1), 1)
        checkpointing.save_checkpoint(1, [model], None, None, 0)  # sync
        out["tracker_sync"] = tracker.read_text() if rank == 0 else None

        args.async_save = True
        model = trained(build(seed=1), 2)
        checkpointing.save_checkpoint(2, [model], None, None, 0)
        trained(model, 1000)  # training goes on: never in step 2
        async_utils.maybe_finalize_async_save(blocking=True)
        out["tracker_async"] = tracker.read_text() if rank == 0 else None
        args.async_save = False

        dist.barrier()
        if rank == 0:
            tracker.write_text("5")  # a tracker naming a step that was never committed
        dist.barrier()
        model = build(seed=2)
        iteration, _ = checkpointing.load_checkpoint([model], None, None)
        out.update(loaded=iteration, exact=exact(model, iteration))

        args.ckpt_step = 1
        model = build(seed=2)
        iteration, _ = checkpointing.load_checkpoint([model], None, None)
        out.update(loaded_step=iteration, exact_step=exact(model, iteration))
    out["uninstalled"] = checkpointing.read_metadata.__module__ == "megatron.training.checkpointing"
    parallel_state.destroy_model_parallel()
    if rank == 0:
        out["folders"] = sorted(os.listdir(ours.folder))
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
