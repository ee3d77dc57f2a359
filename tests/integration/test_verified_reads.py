"""Bytes read back are the bytes written (issue 13, defect 2): every committed file carries the
checksum taken right after it was written; a reader checks what it reads from this node's memory
against it (always for bytes items, which DCP unpickles; for tensors unless turned off), and an
upload refuses bytes that changed in memory since the commit."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter, _arena
from tierckpt_client.dcp.sources.files import LocalFiles
from tierckpt_core import integrity
from tierckpt_core.errors import ProtocolError, UnavailableError
from tierckpt_core.integrity import checksum_blocks
from tierckpt_core.manifest import FileRecord
from tierckpt_core.protocol import CommitRequest, SealFile

from helpers import DaemonProcess, new_shm_dir
from kit import cli, flip_byte, step_paths


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(1 << 16, generator=g), "extra": {"note": "x" * 100, "n": 3}}


def _blank() -> dict[str, object]:
    return {"w": torch.zeros(1 << 16), "extra": {"note": "", "n": 0}}


def _save(ns: str, step: int, *, persist: bool | None = None) -> None:
    writer = TieredStorageWriter(ns, step, persist=persist)
    dcp.async_save(_state(), storage_writer=writer, no_dist=True).result()


def _load(ns: str, step: int) -> dict[str, object]:
    out = _blank()
    dcp.load(out, storage_reader=TieredStorageReader(ns, step), no_dist=True)
    return out


def test_every_committed_file_has_the_writers_checksums(client_env: DaemonProcess) -> None:
    _save("job", 1)
    with DaemonClient() as c:
        files = c.step("job", 1).files
    assert files and all(f.checksum and f.blocks and f.block_size for f in files)


def test_a_flipped_tensor_byte_in_memory_fails_the_load(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save("job", 1)
    data = next(p for name, p in step_paths("job", 1).items() if name.endswith(".data"))
    flip_byte(data, 1000)
    with pytest.raises(CheckpointException, match=r"does not match the checksum taken when"):
        _load("job", 1)
    # Turned off for tensors (TIERCKPT_VERIFY_READS=0) the flip goes through: the cost is the
    # user's choice, documented with its figure in docs/benchmarks.md.
    monkeypatch.setenv("TIERCKPT_VERIFY_READS", "0")
    out = _load("job", 1)
    assert not torch.equal(out["w"], _state()["w"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "at", [100, 6000, 100_000], ids=["shared-block-a", "shared-block-w", "whole-block-w"]
)
def test_a_flipped_byte_fails_the_first_restore_of_a_process(
    client_env: DaemonProcess, at: int
) -> None:
    """The first restore in a process reads tensors with ``preadv`` straight into the destination
    (no mapping) and checks each block there; a block two tensors share is read whole and checked
    privately. A flipped byte anywhere fails the load, and an intact step loads bit-exact."""
    g = torch.Generator().manual_seed(3)
    sd = {"a": torch.randn(1000, generator=g), "w": torch.randn(1 << 15, generator=g)}

    def blank() -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(v) for k, v in sd.items()}

    dcp.save(sd, storage_writer=TieredStorageWriter("fresh", 1), no_dist=True)
    _arena.clear_cache()  # as in a new process: the step's file is not mapped
    out = blank()
    dcp.load(out, storage_reader=TieredStorageReader("fresh", 1), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert not _arena._by_identity, "the test needs the preadv path"

    # One file holds both: "a" at 0, "w" from 4032; blocks of 16 KiB, block 0 shared.
    data = max(step_paths("fresh", 1).values(), key=os.path.getsize)
    flip_byte(data, at)
    _arena.clear_cache()
    with pytest.raises(CheckpointException, match=r"does not match the checksum taken when"):
        dcp.load(blank(), storage_reader=TieredStorageReader("fresh", 1), no_dist=True)


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "first-restore"])
def test_hundreds_of_small_tensors_land_exact_and_a_flip_among_them_fails(
    client_env: DaemonProcess, mapped: bool
) -> None:
    """Hundreds of tensors smaller than a block (a model's biases and norms), each landed from
    the checked private copy of its blocks: out of this process's mapping (it saved the step)
    or with ``preadv`` (a new process): bit-exact, and a flipped byte in any of them fails."""
    g = torch.Generator().manual_seed(5)
    sd = {f"t{i}": torch.randn(1 + (i * 37) % 900, generator=g) for i in range(400)}

    def blank() -> dict[str, torch.Tensor]:
        return {k: torch.full_like(v, -1.0) for k, v in sd.items()}

    dcp.async_save(sd, storage_writer=TieredStorageWriter("small", 1), no_dist=True).result()
    if not mapped:
        _arena.clear_cache()
    out = blank()
    dcp.load(out, storage_reader=TieredStorageReader("small", 1), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert bool(_arena._by_identity) == mapped, "the test needs the path it names"

    data = max(step_paths("small", 1).values(), key=os.path.getsize)
    flip_byte(data, os.path.getsize(data) // 2)
    if not mapped:
        _arena.clear_cache()
    with pytest.raises(CheckpointException, match=r"does not match the checksum taken when"):
        dcp.load(blank(), storage_reader=TieredStorageReader("small", 1), no_dist=True)


class _Planted:
    """A pickle that, when loaded, leaves a file behind: code run in the trainer."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (Path(self.marker), "pwned"))  # type: ignore[return-value]


def test_a_replaced_pickle_is_never_unpickled(
    client_env: DaemonProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERCKPT_VERIFY_READS", "0")  # bytes items are checked regardless
    _save("job", 1)
    extra = next(p for name, p in step_paths("job", 1).items() if not name.endswith(".data"))
    marker = tmp_path / "marker"
    evil = pickle.dumps(_Planted(str(marker)))
    with open(extra, "r+b") as f:  # a member of the daemon's group rewrites the item in place
        f.write(evil)
    with pytest.raises(CheckpointException, match=r"does not match the checksum taken when"):
        _load("job", 1)
    assert not marker.exists()


def test_bytes_changed_after_the_commit_are_not_made_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = DaemonProcess(new_shm_dir(), persist_url=f"file://{tmp_path / 'store'}")
    monkeypatch.setenv("TIERCKPT_SOCKET", str(d.socket))
    try:
        d.start()
        _save("job", 1, persist=False)
        data = next(p for name, p in step_paths("job", 1).items() if name.endswith(".data"))
        flip_byte(data, 5)
        with DaemonClient() as c:
            c.persist("job", 1)
            deadline = time.monotonic() + 30
            while (p := c.status().persistent) is not None and not p.last_error:
                assert time.monotonic() < deadline, p
                time.sleep(0.05)
            assert p is not None and "changed in memory since it was committed" in p.last_error
            assert c.step("job", 1).state.value == "committed"  # not durable
            assert not any(x.durable for x in c.candidates("job"))
    finally:
        d.cleanup()


def test_the_daemon_checksums_files_a_writer_sent_no_checksum_for(
    daemon: DaemonProcess,
) -> None:
    with DaemonClient.from_socket(daemon.socket) as c:
        data = os.urandom(70_000)
        lease = c.lease("raw", 0, len(data))
        with open(lease.path, "r+b") as f:
            f.write(data)
        c.seal("raw", 1, "a", 0, [SealFile(lease_id=lease.lease_id, name="r0", length=len(data))])
        c.commit("raw", 1, "a", CommitRequest(files=["r0"], metadata={}, world_size=1))
        (rec,) = c.step("raw", 1).files
        assert (rec.checksum, rec.block_size, rec.blocks) == checksum_blocks(memoryview(data))


def test_malformed_checksums_are_refused_at_seal(daemon: DaemonProcess) -> None:
    with DaemonClient.from_socket(daemon.socket) as c:
        lease = c.lease("raw", 0, 100)
        bad = SealFile(lease_id=lease.lease_id, name="r0", length=100, checksum="md5:abc")
        with pytest.raises(ProtocolError, match=r"r0: checksum 'md5:abc' is not an xxh3_128"):
            c.seal("raw", 1, "a", 0, [bad])
        ok = bad.model_copy(update={"checksum": None})
        c.seal("raw", 1, "a", 0, [ok])  # the lease was not taken by the refused seal


def _earlier_block_size(length: int) -> int:
    """The block size versions before 2026-11-28 chose: up to 1024 blocks of 16 KiB and more."""
    size = 16 << 10
    while size * 1024 < length:
        size *= 2
    return size


def test_a_step_with_an_earlier_versions_block_size_is_committed_and_read_verified(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint written by an earlier client (blocks of 16 KiB for a 2 MiB file, where this
    version chooses 32 KiB) is accepted by this daemon and loads bit-exact, each of its blocks
    checked: a flipped byte fails the load and names its 16 KiB block."""
    g = torch.Generator().manual_seed(11)
    sd = {"w": torch.randn(1 << 19, generator=g)}  # 2 MiB
    with monkeypatch.context() as m:
        m.setattr(integrity, "block_size", _earlier_block_size)
        dcp.save(sd, storage_writer=TieredStorageWriter("older", 1), no_dist=True)
    with DaemonClient() as c:
        rec = max(c.step("older", 1).files, key=lambda f: f.length)
    assert rec.block_size == 16 << 10 and integrity.block_size(rec.length) == 32 << 10
    out = {"w": torch.zeros(1 << 19)}
    dcp.load(out, storage_reader=TieredStorageReader("older", 1), no_dist=True)
    assert torch.equal(out["w"], sd["w"])
    at = 1 << 20  # in block 64 of 16 KiB (block 32 of 32 KiB)
    flip_byte(step_paths("older", 1)[rec.name], at)
    with pytest.raises(CheckpointException, match=rf"\(block {at // (16 << 10)}, "):
        dcp.load(
            {"w": torch.zeros(1 << 19)},
            storage_reader=TieredStorageReader("older", 1),
            no_dist=True,
        )


@pytest.mark.parametrize(
    ("size", "problem"),
    [
        (48 << 10, r"block size 49152 is not a power of two from 16384 to 65536"),
        (8 << 10, r"block size 8192 is not a power of two from 16384 to 65536"),
        (1 << 20, r"block size 1048576 is not a power of two from 16384 to 65536"),
    ],
    ids=["not-a-power-of-two", "below-16-KiB", "above-this-versions"],
)
def test_a_block_size_no_version_chooses_is_refused_at_seal(
    daemon: DaemonProcess, size: int, problem: str
) -> None:
    """Block sizes are bounded: at least 16 KiB (a record's checksums stay small) and at most
    this version's choice (a ranged read never reads more than its blocks)."""
    data = os.urandom((2 << 20) + 5)
    whole = checksum_blocks(memoryview(data))[0]
    blocks = ["0" * 32] * -(-len(data) // size)
    with DaemonClient.from_socket(daemon.socket) as c:
        lease = c.lease("raw", 0, len(data))
        bad = SealFile(
            lease_id=lease.lease_id,
            name="r0",
            length=len(data),
            checksum=whole,
            block_size=size,
            blocks=blocks,
        )
        with pytest.raises(ProtocolError, match=problem):
            c.seal("raw", 1, "a", 0, [bad])


def test_parameters_that_require_grad_are_restored_in_place(client_env: DaemonProcess) -> None:
    """A state holding a module's parameters themselves (``keep_vars``: they require grad)
    restores into them, verified, and they still require grad; tensors that do not are landed
    in without a detached copy of each."""
    g = torch.Generator().manual_seed(9)
    saved = {"w": torch.randn(1 << 16, generator=g), "b": torch.randn(7, generator=g)}
    dcp.save(saved, storage_writer=TieredStorageWriter("grad", 1), no_dist=True)
    params = {k: torch.nn.Parameter(torch.zeros_like(v)) for k, v in saved.items()}
    before = {k: p.data_ptr() for k, p in params.items()}
    dcp.load(params, storage_reader=TieredStorageReader("grad", 1), no_dist=True)
    for k, p in params.items():
        assert p.requires_grad and p.data_ptr() == before[k]
        assert torch.equal(p.detach(), saved[k])


@pytest.mark.parametrize("kind", ["data", "extra"])
@pytest.mark.parametrize("damage", ["missing", "truncated", "link", "fifo", "directory"])
@pytest.mark.parametrize("dest", ["whole", "strided"])
def test_a_step_whose_file_is_gone_cut_short_or_replaced_is_skipped_by_latest(
    client_env: DaemonProcess, tmp_path: Path, kind: str, damage: str, dest: str
) -> None:
    """A tier file of a committed step deleted, truncated, or replaced by a link (to a copy of
    its own bytes: a load that followed it would read the step), a FIFO (whose open would wait
    for a writer) or a directory is damage, as a changed byte is: a load of "latest" reads the
    next older step instead, an explicit load fails naming the file, and the link's target is
    never opened for writing or read as the step. Into whole tensors (read from the file with
    ``preadv``) and into strided ones (copied out of this process's mapping of the file)."""
    for step in (1, 2):
        _save("dmg", step)
    path = next(p for name, p in step_paths("dmg", 2).items() if name.endswith(f".{kind}"))
    target = tmp_path / "copy-of-the-file"
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        target.write_bytes(Path(path).read_bytes())
        os.unlink(path)
        if damage == "link":
            os.symlink(target, path)
        elif damage == "fifo":
            os.mkfifo(path)
        elif damage == "directory":
            os.mkdir(path)
    before = target.read_bytes() if damage != "truncated" else None

    def blank() -> dict[str, object]:
        out = _blank()
        if dest == "strided":
            out["w"] = torch.zeros(1 << 17)[::2]
        return out

    _arena.clear_cache()  # as in a new process
    out = blank()
    reader = TieredStorageReader("dmg")
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert reader.resolved_step == 1
    assert torch.equal(out["w"], _state()["w"]) and out["extra"] == _state()["extra"]  # type: ignore[arg-type]
    why = {
        "missing": "is missing",
        "truncated": "shorter than the",
        "link": "symbolic link",
        "fifo": "other than a regular file",
        "directory": "directory|other than a regular file",
    }
    with pytest.raises(
        CheckpointException, match=rf"{Path(path).name} in this node's memory .*({why[damage]})"
    ):
        dcp.load(blank(), storage_reader=TieredStorageReader("dmg", 2), no_dist=True)
    if before is not None:
        assert target.read_bytes() == before


@pytest.mark.parametrize("read", ["whole", "strided", "bytes"])
def test_a_trainer_that_cannot_see_the_tier_directory_is_told_so(tmp_path: Path, read: str) -> None:
    """A step directory this process cannot see at all is a trainer whose container does not
    mount the daemon's tier directory where the daemon says, not a damaged step: the read fails
    saying so (it does not fall back past every step, raising false corruption alerts). At the
    seam (the daemon would answer with paths this process cannot see): the files of a step."""
    data = os.urandom(1 << 16)
    whole, size, blocks = checksum_blocks(memoryview(data))
    rec = FileRecord(
        name="r0.data", rank=0, length=len(data), checksum=whole, block_size=size, blocks=blocks
    )
    paths = {"r0.data": str(tmp_path / "not-mounted" / "r0.data")}
    files = LocalFiles(
        "job/step 1", lambda n: _arena.map_file(paths[n]).buffer, paths, records={"r0.data": rec}
    )
    with pytest.raises(UnavailableError, match="which this process cannot see"):
        if read == "whole":
            files.read_into("r0.data", 0, len(data), torch.empty(len(data), dtype=torch.uint8))
        elif read == "strided":
            files.region("r0.data", 0, len(data), "a tensor")
        else:
            files.read_bytes("r0.data", 0, 100, "an item")


def test_a_step_whose_metadata_was_damaged_in_memory_is_skipped_by_latest(
    client_env: DaemonProcess,
) -> None:
    """A commit record in memory whose DCP metadata no longer decodes (one character changed
    inside its compressed text: still valid JSON to the daemon) fails every load of that step.
    A load of "latest" skips it for the next older step, and ``tierckpt verify`` fails it,
    naming the metadata (it said "2 of 2 file(s) verified" before)."""
    for step in (1, 2):
        _save("meta", step)
    record = Path(next(iter(step_paths("meta", 2).values()))).parent / "MANIFEST.json"
    text = record.read_text()
    at = text.index('"metadata":"zlib+b64:') + 40
    record.write_text(text[:at] + ("A" if text[at] != "A" else "B") + text[at + 1 :])
    out = _blank()
    reader = TieredStorageReader("meta")
    dcp.load(out, storage_reader=reader, no_dist=True)
    assert reader.resolved_step == 1
    assert torch.equal(out["w"], _state()["w"]) and out["extra"] == _state()["extra"]  # type: ignore[arg-type]
    verify = cli("verify", "meta", "2", timeout=120)
    assert verify.returncode != 0, verify.stdout
    row = next(line for line in verify.stdout.splitlines() if " metadata " in line)
    assert "CORRUPT" in row and "not readable" in row
    assert cli("verify", "meta", "1", timeout=120).returncode == 0


def test_verify_decodes_the_metadata_as_a_load_does(client_env: DaemonProcess) -> None:
    """Metadata that the daemon inflates and parses but a load cannot decode (valid JSON, a field
    of the wrong kind) failed every load of the step while ``tierckpt verify`` passed it."""
    from tierckpt_core.metadata_blob import pack_metadata, unpack_metadata

    _save("meta", 1)
    record = Path(next(iter(step_paths("meta", 1).values()))).parent / "MANIFEST.json"
    doc = json.loads(record.read_text())
    metadata = unpack_metadata(doc["metadata"], where="the test")
    metadata["state_dict_metadata"]["w"]["kind"] = "sparse"
    doc["metadata"] = pack_metadata(metadata)
    record.write_text(json.dumps(doc))
    with pytest.raises(CheckpointException, match="unknown kind 'sparse'"):
        dcp.load(_blank(), storage_reader=TieredStorageReader("meta", step=1), no_dist=True)
    verify = cli("verify", "meta", "1", timeout=120)
    assert verify.returncode != 0, verify.stdout
    row = next(line for line in verify.stdout.splitlines() if " metadata " in line)
    assert "CORRUPT" in row and "unknown kind 'sparse'" in row, row
