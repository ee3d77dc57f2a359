"""Reading a durable step's commit record while retention deletes it (core/layout.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt_core.errors import NotFoundError, StepNotFoundError
from tierckpt_core.integrity import checksum
from tierckpt_core.layout import manifest_key, marker_key, read_step_manifest, write_step_commit
from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_core.objectstore import FileStore


class _DeletedWhileRead(FileStore):
    """Retention's order (marker first, then the rest) runs between the reader's two reads."""

    def get_bytes(self, key: str) -> bytes:
        if key.endswith(manifest_key("job", 7).rsplit("/", 1)[1]):
            self.delete([marker_key("job", 7), manifest_key("job", 7)])
        return super().get_bytes(key)


def _commit(store: FileStore) -> None:
    data = b"x" * 10
    rec = FileRecord(name="r0", rank=0, length=len(data), checksum=checksum(data))
    write_step_commit(store, StepManifest(namespace="job", step=7, files=[rec], metadata={}))


def test_a_step_deleted_between_marker_and_manifest_reads_as_not_found(tmp_path: Path) -> None:
    store = _DeletedWhileRead(tmp_path)
    _commit(store)
    with pytest.raises(
        StepNotFoundError, match=r"job/step 7 was deleted .* while it was being read"
    ):
        read_step_manifest(store, "job", 7)


def test_a_marker_without_its_manifest_is_not_mistaken_for_a_deletion(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    _commit(store)
    store.delete([manifest_key("job", 7)])  # torn: the marker stays
    with pytest.raises(NotFoundError) as e:
        read_step_manifest(store, "job", 7)
    assert not isinstance(e.value, StepNotFoundError)
