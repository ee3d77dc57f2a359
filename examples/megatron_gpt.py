"""A tiny Megatron-Core GPTModel saved into and loaded from tierckpt (CPU, gloo).

Each rank builds the model (local layer spec, CPU initialization; tensor parallel size --tp;
for a load also --load-tp and --load-pp pipeline stages),
changes every weight by the step number (a stand-in for training), and saves it as
``tierckpt://<namespace>/<step>``; a load builds the model with other weights, loads, and checks
each rank's slice of every global tensor against the whole model built at TP=1, PP=1 and
trained the same, to the last bit. Run with torchrun (or any launcher that sets
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), a tierckpt daemon on the node::

    torchrun --nproc-per-node 2 examples/megatron_gpt.py --namespace gpt --tp 2 --save 100 --async
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --namespace gpt --tp 1 --load latest
    # both in one run, resharding TP=2 -> TP=1 with 2 pipeline stages in between:
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --namespace gpt --tp 2 --save 100 \
        --async --fully-parallel --load latest --load-tp 1 --load-pp 2

Rank 0 prints one JSON line: the step saved or loaded, and whether the load was exact.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
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
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32,
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        # Untied: with pipeline stages Megatron copies the tied weight to the last stage with
        # .cuda() (no GPU here).
        share_embeddings_and_output_weights=False,
    )


def reference() -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    """Every global tensor of the untrained model (seed 1), built whole (TP=1, PP=1), by its
    Megatron key and layer offset: what a load under any sharding is compared with."""
    model = build(seed=1)
    return {
        (t.key, t.global_offset[: t.prepend_axis_num]): t.data.clone()
        for t in _sharded_tensors(model.sharded_state_dict())
    }


def _sharded_tensors(sd: dict[str, Any]) -> list[ShardedTensor]:
    return [t for t in nested_values(sd) if isinstance(t, ShardedTensor)]


def exact_against(
    ref: dict[tuple[str, tuple[int, ...]], torch.Tensor], model: GPTModel, step: int
) -> bool:
    """Each of this rank's shards equals its slice of the reference trained to ``step``."""
    for t in _sharded_tensors(model.sharded_state_dict()):
        whole = ref[(t.key, t.global_offset[: t.prepend_axis_num])] + step
        index = tuple(
            slice(off, off + size)
            for off, size in zip(t.global_offset[t.prepend_axis_num :], t.local_shape, strict=True)
        )
        if not torch.equal(whole[index], t.data):
            return False
    return True


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
    p.add_argument("--load-pp", type=int, default=1, help="pipeline stages for the load")
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
            parallel_state.destroy_model_parallel()
            parallel_state.initialize_model_parallel()  # the reference is built whole
            ref = reference()
            parallel_state.destroy_model_parallel()  # the load's sharding (resharding if other)
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=args.load_tp or args.tp,
                pipeline_model_parallel_size=args.load_pp,
            )
            model = build(seed=2)
            sd = model.sharded_state_dict()
            sd["iteration"] = -1
            step = "" if args.load == "latest" else f"/{args.load}"
            state = tc.load(sd, f"tierckpt://{args.namespace}{step}")
            iteration = state.pop("iteration")
            model.load_state_dict(state)
            flags = [None] * dist.get_world_size()
            dist.all_gather_object(flags, exact_against(ref, model, iteration))
            out.update(loaded=iteration, exact=all(flags))
    finally:
        parallel_state.destroy_model_parallel()
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
