"""The SageMaker-compatible classes: what maps, and what fails loudly."""

from __future__ import annotations

import pytest

from tierckpt_client import InvalidNameError
from tierckpt_client.compat.sagemaker import (
    SageMakerCheckpointConfig,
    SageMakerTieredStorageReader,
    SageMakerTieredStorageWriter,
)


def test_fields_map_onto_writer_and_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_SOCKET", "/nonexistent/daemon.sock")
    monkeypatch.setenv("TIERCKPT_PERSIST_URL", "s3://env-bucket/x")
    cfg = SageMakerCheckpointConfig(
        namespace="job-1", world_size=1, s3_tier_base_path="s3://bucket/ckpt"
    )
    w = SageMakerTieredStorageWriter(checkpoint_config=cfg, step=10)
    assert (w.namespace, w.step, w.persist) == ("job-1", 10, False)
    assert w.config.persist_url == "s3://bucket/ckpt"  # the explicit path wins over the env
    cfg.save_to_s3 = True
    assert SageMakerTieredStorageWriter(cfg, step=50).persist is True
    r = SageMakerTieredStorageReader(checkpoint_config=cfg)
    assert (r.namespace, r.step, r.config.persist_url) == ("job-1", None, "s3://bucket/ckpt")
    assert SageMakerTieredStorageReader(cfg, step=7).step == 7
    w2 = SageMakerTieredStorageWriter(cfg, path="tierckpt://job-1/20")
    assert w2.step == 20


def test_what_cannot_be_honoured_says_so() -> None:
    with pytest.raises(InvalidNameError, match="namespace"):
        SageMakerCheckpointConfig(namespace="bad/name", world_size=1)
    with pytest.raises(ValueError, match="s3_path_strategy"):
        SageMakerCheckpointConfig(namespace="j", world_size=1, s3_path_strategy="hashed")
    with pytest.raises(ValueError, match="s3_tier_base_path"):
        SageMakerCheckpointConfig(namespace="j", world_size=1, s3_tier_base_path="bucket/x")
    cfg = SageMakerCheckpointConfig(namespace="j", world_size=4)
    with pytest.raises(ValueError, match=r"world_size=4\) but the process group has 1 ranks"):
        SageMakerTieredStorageWriter(cfg, step=1)
    ok = SageMakerCheckpointConfig(namespace="j", world_size=1)
    with pytest.raises(ValueError, match="leave path None"):
        SageMakerTieredStorageWriter(ok, path="/fsx/ckpt/step_1", step=1)
