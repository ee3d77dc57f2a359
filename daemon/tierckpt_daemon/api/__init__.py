"""HTTP API of the daemon: one router per resource, thin handlers over :class:`TierService`."""

from tierckpt_daemon.api.app import create_app

__all__ = ["create_app"]
