"""A ``DTensor``'s shard, taken as it is: the one test the Checkpointer's load and save plans
share for the ``DTensor``s they handle themselves."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors no subclass makes behave otherwise


def plain_shard(obj: Any) -> torch.Tensor | None:
    """The local tensor of a ``DTensor`` (exactly) whose shard is a plain tensor: what
    ``to_local()`` returns outside autograd (or a view of, for a parameter: the same memory),
    without the autograd call (~60 us). None for anything else (a subclass shard, e.g. a
    low-precision training tensor, chunks and resolves itself)."""
    if type(obj) is not DTensor:
        return None
    local = obj._local_tensor
    return local if type(local) in PLAIN else None
