"""tierckpt daemon: keeps DCP shards in a node-local shared-memory tier (no torch in here)."""

__version__ = "0.1.0"
