"""Every-step checkpointing: the step-time cost of ``Checkpointer(every=1)`` in an FSDP2 loop.

One run, two ranks (spawn + gloo, CPU), one daemon. The loop alternates blocks of steps without
checkpointing and blocks with a save after every step, so both see the same machine load; a block
with saves ends with ``wait()`` for its last save, counted in that block. Printed: median and mean
step time of each, the overhead, and the stall inside ``save()``.

    python bench/every_step.py                         # ~190 MB of state (params + AdamW), small
    python bench/every_step.py --dim 2048 --layers 8   # larger (keep the state <= 256 MiB here)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parent))
from harness import free_port, machine_info, start_daemon


class _App(Stateful):
    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt

    def state_dict(self) -> dict[str, Any]:
        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )


def _rank(
    rank: int, world: int, port: int, socket: str, args: argparse.Namespace, out: str
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TIERCKPT_SOCKET=socket, RANK=str(rank)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tierckpt_client import Checkpointer

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.dim, args.dim) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    app = _App(model, opt)
    x = torch.randn(args.batch, args.dim)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # warm-up: allocate optimizer state, first-touch pages
        step()
    times: dict[str, list[float]] = {"off": [], "on": []}
    stalls: list[float] = []
    n = 0
    with Checkpointer("bench-every-step", every=1, async_mode=args.async_mode) as ckpt:
        ckpt.save(0, {"app": app})  # the first save leases fresh memory: not a steady step
        ckpt.wait()
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                for i in range(args.block):
                    dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    if mode == "on":
                        n += 1
                        s0 = time.perf_counter()
                        ckpt.save(n, {"app": app})
                        stalls.append(time.perf_counter() - s0)
                        if i == args.block - 1:
                            ckpt.wait()
                    times[mode].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "stalls": stalls}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--block", type=int, default=5, help="steps per block")
    p.add_argument("--rounds", type=int, default=4, help="(off, on) block pairs")
    p.add_argument("--async-mode", choices=["thread", "process"], default="thread")
    args = p.parse_args()
    from tierckpt_core.launcher import new_shm_dir

    params = args.layers * (args.dim * args.dim + args.dim)
    state_mb = params * 4 * 3 / 1e6  # fp32 params + AdamW's two moments
    daemon = start_daemon(2048, set_env=False)
    out = Path(new_shm_dir("tierckpt-bench-out").with_suffix(".json"))
    try:
        mp.spawn(
            _rank,
            args=(2, free_port(), str(daemon.socket), args, str(out)),
            nprocs=2,
            join=True,
        )
        res = json.loads(out.read_text())
    finally:
        daemon.cleanup()
        out.unlink(missing_ok=True)
    off, on, stalls = res["times"]["off"], res["times"]["on"], res["stalls"]
    overhead = statistics.mean(on) / statistics.mean(off) - 1
    overhead_median = statistics.median(on) / statistics.median(off) - 1
    print(json.dumps(machine_info(state_mb=round(state_mb), **vars(args))))
    print(f"| FSDP2, 2 ranks, {state_mb:.0f} MB state | step median (s) | step mean (s) |")
    print("|---|---|---|")
    print(f"| no checkpointing | {statistics.median(off):.3f} | {statistics.mean(off):.3f} |")
    print(f"| Checkpointer(every=1) | {statistics.median(on):.3f} | {statistics.mean(on):.3f} |")
    print(
        f"overhead: {overhead * 100:+.1f} % (means), {overhead_median * 100:+.1f} % (medians); "
        f"median save() stall {statistics.median(stalls) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
