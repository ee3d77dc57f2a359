"""The Checkpointer saves with DCP's plan caching on, under a key of its own: an unchanged layout
skips the global planning (~100 ms of every save's background work with 2048 tensors on the
2-core box), and two Checkpointers of other layouts in one process never share a cached plan."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from tierckpt_client import Checkpointer

from helpers import DaemonProcess


def _state(n: int, fill: float) -> dict[str, Any]:
    return {"model": {f"w{i}": torch.full((64 + i,), fill + i) for i in range(n)}}


def _zeros(sd: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}


def test_two_checkpointers_cache_their_own_plans_and_restore_every_step(
    client_env: DaemonProcess, monkeypatch: Any
) -> None:
    planned: list[int] = []  # the global plans DCP made (a cached save makes none)
    real = DefaultSavePlanner._create_global_plan

    def counted(self: Any, all_plans: Any) -> Any:
        planned.append(len(all_plans))
        return real(self, all_plans)

    monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan", counted)
    a = Checkpointer("plans-a", async_staging=False, handle_signals=False)
    b = Checkpointer("plans-b", async_staging=False, handle_signals=False)
    try:
        saved = {}
        for step in (1, 2, 3):
            for ckpt, n in ((a, 3), (b, 5)):
                sd = _state(n, 10.0 * step)
                ckpt.save(step, sd)
                ckpt.wait()
                saved[ckpt.namespace, step] = sd
        assert len(planned) == 2  # the first save of each layout; the others were cached
        keys = {a._plans, b._plans}
        assert keys <= set(SavePlanner._cached_global_plan)
        for ckpt in (a, b):
            dst = _zeros(saved[ckpt.namespace, 3])
            assert ckpt.restore(dst) == 3
            want = saved[ckpt.namespace, 3]["model"]
            assert all(torch.equal(dst["model"][k], v) for k, v in want.items())
        grown = _state(4, 40.0)  # a changed layout plans again
        a.save(4, grown)
        a.wait()
        assert len(planned) == 3
        dst = _zeros(grown)
        assert a.restore(dst) == 4
        assert all(torch.equal(dst["model"][k], v) for k, v in grown["model"].items())
    finally:
        a.close()
        b.close()
    assert not keys & set(SavePlanner._cached_global_plan)  # forgotten at close
