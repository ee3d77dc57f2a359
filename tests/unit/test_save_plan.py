"""The save loops' planner makes a ``DTensor``'s write item without DCP's per-``DTensor`` work:
the plan equals DCP's own, item for item, on FSDP2 and HSDP meshes of two ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

from tierckpt_client import _save_loop, _save_plan

from helpers import run_ranks
from kit import DTENSOR_KEYS, dtensor_meshes, dtensor_state


def _counting(asked: list[str], own: Any) -> Any:
    """``own`` (a method), noting in ``asked`` the key of each call."""

    def counted(self: Any, fqn: str, obj: Any) -> Any:
        asked.append(fqn)
        return own(self, fqn, obj)

    return counted


def _items(planner: Any, state: dict[str, Any], rank: int) -> list[Any]:
    planner.set_up_planner(state, None, rank == 0)
    return planner.create_local_plan().items


def _ranks(rank: int, world: int, path: str) -> None:
    from torch.distributed.tensor import DTensor

    for name, mesh, placements in dtensor_meshes(world):
        for grad in (True, False):
            state = dtensor_state(mesh, placements, 1)
            asked: list[str] = []
            counted = _counting(asked, DTensor.__create_write_items__)
            own = DTensor.__create_write_items__

            with torch.set_grad_enabled(grad):
                DTensor.__create_write_items__ = counted  # type: ignore[method-assign]
                mine = _save_loop.caching_planner(f"test-{name}-{grad}")
                try:
                    ours = _items(mine, state, rank)
                finally:
                    DTensor.__create_write_items__ = own  # type: ignore[method-assign]
                # One DTensor asked per shape (w, w2 and nested.m share theirs), not each.
                assert sorted(asked) == ["b", "one", "p", "w"], asked
                dcps = DefaultSavePlanner()
                theirs = _items(dcps, state, rank)
                for item in ours:  # each resolves to the data DCP resolves it to
                    got, want = mine.resolve_data(item), dcps.resolve_data(item)
                    if isinstance(want, torch.Tensor):
                        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
                        assert got.dtype == want.dtype and torch.equal(got, want)
                    else:
                        assert got.getvalue() == want.getvalue()
                flat_state = DefaultSavePlanner()
                flat_state.set_up_planner(state, None, rank == 0)
                known = _save_plan.with_known_items(flat_state.state_dict)
            assert ours == theirs, (name, grad, rank)  # every field of every item
            assert known is not None
            stood_in = {k for k, v in known.items() if isinstance(v, _save_plan._Known)}
            assert stood_in == {"w", "b", "one", "w2", "p", "nested.m"}, stood_in
            _save_loop.forget_plans(f"test-{name}-{grad}")
        # Saved with it and loaded back: the values.
        where = f"{path}/{name}"
        dcp.save(
            dtensor_state(mesh, placements, 1),
            storage_writer=dcp.FileSystemWriter(where),
            planner=_save_loop.caching_planner(f"save-{name}"),
        )
        _save_loop.forget_plans(f"save-{name}")
        back = dtensor_state(mesh, placements, 2)
        dcp.load(back, storage_reader=dcp.FileSystemReader(where))
        want = dtensor_state(mesh, placements, 1)
        for k in DTENSOR_KEYS:
            assert torch.equal(back[k].full_tensor(), want[k].full_tensor()), (name, k)
        assert torch.equal(back["nested"]["m"].full_tensor(), want["nested"]["m"].full_tensor())
        assert back["step"] == 1


def test_dtensor_write_items_equal_dcps_and_the_save_loads_back(tmp_path: Path) -> None:
    run_ranks(_ranks, 2, str(tmp_path))


def test_a_state_without_dtensors_is_left_to_dcp() -> None:
    assert _save_plan.with_known_items({"w": torch.zeros(3), "step": 1}) is None


def test_a_save_that_cannot_commit_across_nodes_says_whether_a_daemon_is_down() -> None:
    """A node's daemon down made the save say the daemons "are not peers of each other (set
    TIERCKPT_PEERS ...)": the operator went looking at a configuration that was right."""
    from tierckpt_client.dcp._plan_data import LocalPlanData, RankLayout

    up = LocalPlanData(direct=False, daemon="nodeA:/dev/shm/tierckpt/daemon.sock", node="a:8474")
    down = LocalPlanData(direct=True, daemon="nodeB:/dev/shm/tierckpt/daemon.sock")
    layout = RankLayout([up, down], daemons=2, rank_nodes=None)
    assert layout.unpeered
    why = layout.why_unpeered("job", 7)
    assert "rank(s) 1 cannot reach their node's daemon (nodeB:" in why, why
    assert "not peers" not in why
    alone = LocalPlanData(direct=False, daemon="nodeB:/dev/shm/tierckpt/daemon.sock")
    unconfigured = RankLayout([up, alone], daemons=2, rank_nodes=None)
    assert "which are not peers of each other (set TIERCKPT_PEERS" in unconfigured.why_unpeered(
        "job", 7
    )
    # Two nodes' daemons given the same TIERCKPT_NODE_NAME: said as that, not "not peers".
    twin = LocalPlanData(direct=False, daemon="nodeC:/dev/shm/tierckpt/daemon.sock", node="a:8474")
    same = RankLayout.of("job", 7, [SavePlan([], storage_data=x) for x in (up, twin)])
    assert same.unpeered
    assert same.why_unpeered("job", 7) == (
        "job/step 7: the daemons nodeA:/dev/shm/tierckpt/daemon.sock, "
        "nodeC:/dev/shm/tierckpt/daemon.sock all call themselves node a:8474: each node's daemon "
        "needs its own TIERCKPT_NODE_NAME (its own entry of TIERCKPT_PEERS)"
    )
