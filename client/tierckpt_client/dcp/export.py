"""Export a tierckpt step as a standard DCP checkpoint directory that torch's own
``FileSystemReader`` loads, so a checkpoint never depends on this software to be used."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp._metadata_codec import DTYPES, ShardRef
from tierckpt_client.dcp.reader import TieredStorageReader

DATA_FILE = "__0_0.distcp"


def export_step(
    namespace: str,
    step: int | None,
    dest: str | os.PathLike[str],
    *,
    config: ClientConfig | None = None,
) -> int:
    """Write ``namespace``/``step`` (newest if None) to ``dest`` in torch's FileSystemWriter format.

    Reads from the daemon's memory tier (hydrating from the persistent tier if needed) or, without
    a daemon, straight from ``TIERCKPT_PERSIST_URL``. Returns the step written.
    """
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    if (out / ".metadata").exists():
        raise FileExistsError(f"{out} already holds a DCP checkpoint; choose an empty directory")
    reader = TieredStorageReader(namespace, step, config=config)
    metadata = reader.read_metadata()
    refs: dict[MetadataIndex, ShardRef] = dict(metadata.storage_data or {})
    infos: dict[MetadataIndex, _StorageInfo] = {}
    with reader.open_files(list(refs.values())) as files, open(out / DATA_FILE, "wb") as data:
        for index, ref in refs.items():
            raw = files.region(ref.file, ref.offset, ref.length, index.fqn)
            if ref.dtype is None or ref.shape is None:
                payload = raw.numpy().tobytes()
            else:
                tensor = raw.view(DTYPES[ref.dtype]).view(ref.shape).clone()  # its own storage
                stream = io.BytesIO()
                torch.save(tensor, stream)
                payload = stream.getvalue()
            infos[index] = _StorageInfo(DATA_FILE, data.tell(), len(payload))
            data.write(payload)
        data.flush()
        os.fsync(data.fileno())
    metadata.storage_data = infos
    metadata.storage_meta = None
    tmp = out / ".metadata.tmp"
    with open(tmp, "wb") as fh:
        pickle.dump(metadata, fh)  # torch's own format for .metadata
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / ".metadata")
    resolved = reader.resolved_step
    assert resolved is not None
    return resolved
