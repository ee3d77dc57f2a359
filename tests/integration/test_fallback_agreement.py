"""How the ranks of a load of "latest" agree, on a real gloo group of two processes: the step
rank 0 chose (or its error) reaches every rank, and every rank learns the worst outcome of the
read and the messages of the ranks that found the step corrupt. On a group that takes CPU
tensors the common answers travel as one integer (a step, "every rank read it"); an error and
a corrupt step still travel whole."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tierckpt_client.dcp._fallback import CORRUPT, FAILED, OK, Agreement, agree, decide, outcome
from tierckpt_core.errors import IntegrityError, NamespaceNotFoundError, StepStateError

from helpers import run_ranks


def _decide_worker(rank: int, world: int) -> None:
    how = Agreement(alone=False)
    sent: list[str] = []
    real_object, real_tensor = dist.broadcast_object_list, dist.broadcast

    def counted_object(*args: object, **kwargs: object) -> None:
        sent.append("object")
        real_object(*args, **kwargs)  # type: ignore[arg-type]

    def counted_tensor(*args: object, **kwargs: object) -> None:
        sent.append("tensor")
        real_tensor(*args, **kwargs)  # type: ignore[arg-type]

    dist.broadcast_object_list, dist.broadcast = counted_object, counted_tensor  # type: ignore[assignment]
    for step in (7, 0):
        assert decide(how, lambda s=step: s if rank == 0 else -5, "latest") == step
    assert sent == ["tensor", "tensor"]  # one integer each, no object

    def missing() -> int:
        raise NamespaceNotFoundError("namespace job has no committed step in memory")

    with pytest.raises(NamespaceNotFoundError, match="no committed step in memory") as e:
        decide(how, missing, "latest")
    if rank == 1:  # the error, as rank 0 met it, by its code
        assert "rank 0 could not resolve latest" in str(e.value)
    assert sent[2:] == ["tensor", "object"]
    assert decide(how, lambda: 3, "latest") == 3  # the ranks are in step after an error


def _agree_worker(rank: int, world: int) -> None:
    how = Agreement(alone=False)
    assert agree(outcome(None), how) == (OK, [])
    bad = IntegrityError("step 6: r1.data block 3 does not match") if rank == 1 else None
    assert agree(outcome(bad), how) == (CORRUPT, ["rank 1: step 6: r1.data block 3 does not match"])
    worse = StepStateError("gone") if rank == 0 else IntegrityError("block 2")
    assert agree(outcome(worse), how) == (FAILED, ["rank 1: block 2"])
    assert agree(outcome(None), how) == (OK, [])


def test_the_step_rank_0_chose_or_its_error_reaches_every_rank() -> None:
    run_ranks(_decide_worker, 2)


def test_every_rank_learns_the_worst_outcome_and_who_found_corruption() -> None:
    run_ranks(_agree_worker, 2)
