"""A tiny Megatron-Core GPTModel saved into and loaded from tierckpt (CPU, gloo).

Each rank builds the model (local layer spec, CPU initialization; tensor parallel size --tp),
changes every weight by the step number (a stand-in for training), and saves it as
``tierckpt://<namespace>/<step>``; a load builds the model with other weights, loads, and checks
every weight against what was saved, to the last bit. Run with torchrun (or any launcher that sets
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), a tierckpt daemon on the node::

    torchrun --nproc-per-node 2 examples/megatron_gpt.py --namespace gpt --tp 2 --save 100 --async
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --namespace gpt --tp 1 --load latest
    # both in one run, resharding TP=2 -> TP=1 in between:
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --namespace gpt --tp 2 --save 100 \
        --async --fully-parallel --load latest --load-tp 1

Rank 0 prints one JSON line: the step saved or loaded, and whether the load was exact.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from tierckpt_client.integrations import megatron as tc


def build(seed: int) -> GPTModel:
    torch.manual_seed(seed)  # CPU initialization: the global weights do not depend on --tp
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
            p.add_(step)  # elementwise: the same change whatever the sharding
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--namespace", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--save", type=int, help="save this step")
    p.add_argument("--load", help="a step, or 'latest'")
    p.add_argument("--async", dest="async_", action="store_true")
    p.add_argument("--load-tp", type=int, help="tensor parallel size for the load (default --tp)")
    p.add_argument("--fully-parallel", action="store_true", help="Megatron's fully-parallel save")
    p.add_argument("--sockets", help="comma-separated daemon socket per rank (several nodes)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.sockets:
        os.environ["TIERCKPT_SOCKET"] = args.sockets.split(",")[rank]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    out: dict[str, object] = {}
    try:
        if args.save is not None:
            model = trained(build(seed=1), args.save)
            sd = model.sharded_state_dict()
            sd["iteration"] = args.save  # non-tensor: Megatron's common state
            ckpt = f"tierckpt://{args.namespace}/{args.save}"
            req = tc.save(sd, ckpt, async_=args.async_, fully_parallel=args.fully_parallel)
            if req is not None:
                trained(model, 1000)  # training goes on: never in the step
                req.result(timeout=120)
                out["done"] = req.done()
            out["saved"] = args.save
        if args.load is not None:
            if args.load_tp is not None and args.load_tp != args.tp:
                parallel_state.destroy_model_parallel()  # resharding: another TP size
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.load_tp)
            model = build(seed=2)
            sd = model.sharded_state_dict()
            sd["iteration"] = -1
            step = "" if args.load == "latest" else f"/{args.load}"
            state = tc.load(sd, f"tierckpt://{args.namespace}{step}")
            iteration = state.pop("iteration")
            model.load_state_dict(state)
            want = trained(build(seed=1), iteration).state_dict()
            got = model.state_dict()
            exact = all(
                torch.equal(got[k], v) for k, v in want.items() if isinstance(v, torch.Tensor)
            )
            flags = [None] * dist.get_world_size()
            dist.all_gather_object(flags, exact)
            out.update(loaded=iteration, exact=all(flags))
    finally:
        parallel_state.destroy_model_parallel()
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
