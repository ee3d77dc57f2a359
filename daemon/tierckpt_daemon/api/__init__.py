"""HTTP API of the daemon: one router per resource, thin handlers over the daemon's parts
(:class:`~tierckpt_daemon.node.Node`)."""

from tierckpt_daemon.api.app import create_app

__all__ = ["create_app"]
