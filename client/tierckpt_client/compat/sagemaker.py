"""The SageMaker managed tiered checkpointing client's classes, on tierckpt.

A loop written for ``amzn-sagemaker-checkpointing`` runs unchanged once its import line names this
module (see docs/migration.md): the same constructor arguments, mapped onto
:class:`~tierckpt_client.dcp.TieredStorageWriter` / :class:`~tierckpt_client.dcp.TieredStorageReader`.

Mapping:
    ``namespace``: the tierckpt namespace (validated: letters, digits, ``.``, ``_``, ``-``).
    ``world_size``: checked against the process group when a writer or reader is created.
    ``s3_tier_base_path``: the client's persistent tier (:attr:`ClientConfig.persist_url`): used
        for degraded saves and daemon-less restores. The daemon's own tier
        (``TIERCKPT_PERSIST_URL``) is where it uploads; a daemon without one cannot honour
        ``save_to_s3`` and the writer says so once.
    ``s3_path_strategy``: only ``None`` (tierckpt's one layout,
        ``{base}/{namespace}/step_{N:012d}/``); anything else raises ``ValueError``.
    ``save_to_s3``: read when a writer is created: ``True`` persists that step
        (``persist=True``), ``False`` keeps it in memory (``persist=False``).
    ``logger``: receives this module's messages (default: this module's logger).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp.ids import is_checkpoint_id
from tierckpt_core.errors import DaemonUnavailableError, InvalidNameError
from tierckpt_core.names import validate_namespace

_logger = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


@dataclass
class SageMakerCheckpointConfig:
    """The reference's configuration object; mutable, as its loop flips ``save_to_s3``."""

    namespace: str
    world_size: int
    s3_tier_base_path: str | None = None
    s3_path_strategy: Any = None
    save_to_s3: bool = False
    logger: logging.Logger | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.namespace = validate_namespace(self.namespace)
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int):
            raise ValueError(f"world_size must be an int, got {self.world_size!r}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.s3_path_strategy is not None:
            raise ValueError(
                f"s3_path_strategy={self.s3_path_strategy!r} is not supported: tierckpt stores "
                "every step at {s3_tier_base_path}/{namespace}/step_{N:012d}/; pass None"
            )
        if self.s3_tier_base_path is not None and not self.s3_tier_base_path.startswith(
            ("s3://", "file://")
        ):
            raise ValueError(
                f"s3_tier_base_path={self.s3_tier_base_path!r} must be s3://bucket/prefix "
                "(or file:///path)"
            )

    @property
    def log(self) -> logging.Logger:
        return self.logger or _logger

    def client_config(self) -> ClientConfig:
        """How writers and readers reach the daemon, with ``s3_tier_base_path`` as the client's
        persistent tier (it wins over ``TIERCKPT_PERSIST_URL``, as explicit arguments do)."""
        return ClientConfig.from_env(persist_url=self.s3_tier_base_path)

    def check_world_size(self, group: dist.ProcessGroup | None = None) -> None:
        actual = dist.get_world_size(group) if dist.is_initialized() else 1
        if actual != self.world_size:
            raise ValueError(
                f"SageMakerCheckpointConfig(world_size={self.world_size}) but the process group "
                f"has {actual} ranks; set world_size to the number of training processes"
            )


def _warn_once(cfg: SageMakerCheckpointConfig, key: str, msg: str, *args: object) -> None:
    if (cfg.namespace, key) not in _warned:
        _warned.add((cfg.namespace, key))
        cfg.log.warning(msg, *args)


class SageMakerTieredStorageWriter(TieredStorageWriter):
    """``SageMakerTieredStorageWriter(checkpoint_config, path=None, step=None)`` on tierckpt.

    ``path`` may be a ``tierckpt://<namespace>/<step>`` id; any other path raises ``ValueError``
    (tierckpt addresses steps by namespace and number). ``step`` is required by the time DCP
    writes (tierckpt raises a clear error otherwise).
    """

    def __init__(
        self,
        checkpoint_config: SageMakerCheckpointConfig,
        path: str | os.PathLike[str] | None = None,
        step: int | None = None,
    ) -> None:
        if path is not None and not is_checkpoint_id(path):
            raise ValueError(
                f"path={os.fspath(path)!r}: tierckpt stores steps by namespace and number; "
                "leave path None and pass step="
            )
        checkpoint_config.check_world_size()
        super().__init__(
            checkpoint_config.namespace,
            step,
            persist=bool(checkpoint_config.save_to_s3),
            config=checkpoint_config.client_config(),
        )
        if path is not None:
            self.reset(path)
        self.checkpoint_config = checkpoint_config
        if checkpoint_config.save_to_s3:
            self._check_daemon_tier(checkpoint_config)

    def _check_daemon_tier(self, cfg: SageMakerCheckpointConfig) -> None:
        try:
            persistent = DaemonClient.shared(self.config).status().persistent
        except DaemonUnavailableError:
            return  # the save itself degrades (to s3_tier_base_path) or raises, and says so
        if persistent is None:
            _warn_once(
                cfg,
                "no-tier",
                "%s: save_to_s3=True but the tierckpt daemon has no persistent tier "
                "(TIERCKPT_PERSIST_URL): steps stay in memory only",
                cfg.namespace,
            )
        elif cfg.s3_tier_base_path and persistent.url.rstrip("/") != cfg.s3_tier_base_path.rstrip(
            "/"
        ):
            _warn_once(
                cfg,
                "other-tier",
                "%s: s3_tier_base_path=%s but the daemon persists to %s; the daemon's tier wins",
                cfg.namespace,
                cfg.s3_tier_base_path,
                persistent.url,
            )


class SageMakerTieredStorageReader(TieredStorageReader):
    """``SageMakerTieredStorageReader(checkpoint_config, step=None)`` on tierckpt: ``step=None``
    loads the newest step in memory or in the persistent tier that verifies, agreed by all ranks
    (rank 0 decides); an older step is used, with a warning, if a newer one is damaged."""

    def __init__(
        self, checkpoint_config: SageMakerCheckpointConfig, step: int | None = None
    ) -> None:
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise InvalidNameError(f"step must be an int or None, got {step!r}")
        checkpoint_config.check_world_size()
        super().__init__(
            checkpoint_config.namespace, step, config=checkpoint_config.client_config()
        )
        self.checkpoint_config = checkpoint_config


__all__ = [
    "SageMakerCheckpointConfig",
    "SageMakerTieredStorageReader",
    "SageMakerTieredStorageWriter",
]
