"""What every node holds: this daemon asks its peers (``tierckpt ls --cluster``)."""

from __future__ import annotations

import socket
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from tierckpt_core.protocol import ClusterListing, NodeListing
from tierckpt_daemon.api.deps import get_node
from tierckpt_daemon.node import Node
from tierckpt_daemon.peers import cluster

router = APIRouter(prefix="/v1/cluster")


@router.get("")
def list_cluster(
    request: Request,
    node: Annotated[Node, Depends(get_node)],
    namespace: str | None = None,
    timeout_s: Annotated[float, Query(gt=0, le=cluster.MAX_TIMEOUT_S)] = 5.0,
) -> ClusterListing:
    """Each node's committed steps in memory; a peer that does not answer within ``timeout_s``
    is listed as unreachable. Without peers, this node alone."""
    if node.cluster is None:
        name = request.app.state.settings.node_name or socket.gethostname()
        own = NodeListing(
            node=name, reachable=True, steps=cluster.inventory(node.service, namespace)
        )
        return ClusterListing(node=None, timeout_s=timeout_s, nodes=[own])
    return node.cluster.listing(namespace, timeout_s)
