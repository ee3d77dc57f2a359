"""``verify NS STEP``: read every file of a step in every tier that holds it and check its checksum.

Memory: the step is pinned through the daemon (so eviction cannot pull it away mid-read) and each
file is checksummed against the checksum taken when it was written (by the rank that wrote it, or
by the daemon at the commit). A file the daemon has no checksum for (a step committed by an older
daemon) is reported as "not yet checksummed", never as passed; the step's DCP metadata must
decode (a commit record damaged in memory fails every load of the step). Persistent: the commit
marker must match the manifest, then every file is streamed from the store and checked against
the manifest.
Replicas on peers are verified by the peer that holds them, when it serves or receives them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass

from tierckpt_client.cli import _render as r
from tierckpt_client.cli._tiers import Persistent
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core.errors import (
    CheckpointFormatError,
    IntegrityError,
    NotFoundError,
    StepNotFoundError,
    TierCkptError,
    UnavailableError,
)
from tierckpt_core.integrity import checksum_file
from tierckpt_core.layout import file_key
from tierckpt_core.protocol import CorruptionReport, validate_namespace, validate_step

OK, CORRUPT, MISSING, UNCHECKED = "ok", "CORRUPT", "MISSING", "not yet checksummed"


class VerifyFailedError(TierCkptError):
    """A file of the step is corrupt or missing in some tier."""


class NotVerifiedError(TierCkptError):
    """Nothing is corrupt, but some files could not be checked (no checksum known yet)."""


@dataclass
class Result:
    tier: str
    rank: int
    file: str
    bytes: int
    result: str
    detail: str = ""


def cmd_verify(client: DaemonClient, tier: Persistent, args: argparse.Namespace) -> None:
    ns, step = validate_namespace(args.namespace), validate_step(args.step)
    results: list[Result] = []
    tiers: list[str] = []
    with r.byte_progress() as bar:
        memory = None if tier.offline else _verify_memory(client, ns, step, bar)
        if memory is not None:
            tiers.append("memory")
            results += memory
        persistent = _verify_persistent(tier, ns, step, bar)
        if persistent is not None:
            tiers.append("persistent")
            results += persistent
    if not tiers:
        where = f" or in {tier.url}" if tier.url else ""
        raise StepNotFoundError(f"{ns}/step {step} is not in memory{where}")
    bad = [x for x in results if x.result in (CORRUPT, MISSING)]
    for x in bad:
        if x.result == CORRUPT and not tier.offline:  # for the daemon's metrics and log
            name = x.file if x.rank >= 0 else None  # (the metadata, a manifest: no shard file)
            report = CorruptionReport(file=name, tier=x.tier, detail=x.detail[:2000])
            client.report_corruption(ns, step, report)
    unchecked = [x for x in results if x.result == UNCHECKED]
    doc = {
        "namespace": ns,
        "step": step,
        "tiers": tiers,
        "ok": not bad and not unchecked,
        "files": [asdict(x) for x in results],
    }
    rows = [(x.tier, x.rank, x.file, r.size(x.bytes), x.result, x.detail) for x in results]
    summary = (
        f"{ns} step {step}: {len(results) - len(bad) - len(unchecked)} of {len(results)} file(s) "
        f"verified in {', '.join(tiers)}"
    )
    text = r.table(("TIER", "RANK", "FILE", "SIZE", "RESULT", "DETAIL"), rows) + "\n" + summary
    r.emit(args.json, doc, text)
    if bad:
        raise VerifyFailedError(f"{ns} step {step}: {len(bad)} file(s) corrupt or missing")
    if unchecked:
        raise NotVerifiedError(
            f"{ns} step {step}: {len(unchecked)} file(s) in memory not yet checksummed by the "
            "daemon (it records checksums when it uploads or replicates a step); not verified"
        )


def _verify_memory(
    client: DaemonClient, ns: str, step: int, bar: r.Progress
) -> list[Result] | None:
    try:
        pin = client.pin(ns, step)
    except NotFoundError:
        return None
    try:
        files = sorted(pin.step.files, key=lambda f: (f.rank, f.name))
        task = bar.add_task(f"memory {ns} step {step}", total=sum(f.length for f in files))
        out = []
        for f in files:
            if f.checksum is None:
                out.append(Result("memory", f.rank, f.name, f.length, UNCHECKED))
            else:
                try:
                    got = checksum_file(pin.paths[f.name], f.length)
                except (OSError, KeyError) as e:
                    out.append(Result("memory", f.rank, f.name, f.length, MISSING, str(e)))
                else:
                    out.append(_compare("memory", f.rank, f.name, f.length, got, f.checksum))
            bar.advance(task, f.length)
        try:  # the DCP metadata in its commit record: a load of the step decodes it first
            _decode(client.metadata(ns, step))
        except CheckpointFormatError as e:
            out.append(Result("memory", -1, "metadata", 0, CORRUPT, str(e)))
        except (NotFoundError, UnavailableError) as e:  # kept by other nodes, out of reach now
            r.warn(f"{ns}/step {step}: its metadata was not checked: {e}")
        return out
    finally:
        client.unpin(ns, step, pin.pin_id)


def _decode(doc: dict[str, object]) -> None:
    """Decode the step's metadata as a load does (the daemon only inflated and parsed it):
    CheckpointFormatError if a load could not (a field of the wrong kind, a tensor without its
    chunks); torch is imported for it (the client's decoder builds DCP's own classes)."""
    from tierckpt_client.dcp._metadata_codec import decode_metadata

    decode_metadata(doc)


def _verify_persistent(
    tier: Persistent, ns: str, step: int, bar: r.Progress
) -> list[Result] | None:
    if tier.store is None:
        return None
    try:
        manifest = tier.manifest(ns, step)  # checks the marker against the manifest
    except IntegrityError as e:
        return [Result("persistent", -1, "manifest.json", 0, CORRUPT, str(e))]
    if manifest is None:
        return None
    store = tier.store
    task = bar.add_task(f"persistent {ns} step {step}", total=sum(f.length for f in manifest.files))
    out = []
    sink = os.open(os.devnull, os.O_WRONLY)  # stream and checksum, keep nothing
    try:
        for f in manifest.files:
            try:
                got = store.get_to_file(file_key(ns, step, f.name), sink, f.length)
            except NotFoundError as e:
                out.append(Result("persistent", f.rank, f.name, f.length, MISSING, str(e)))
            except IntegrityError as e:  # the object's size differs from the manifest's
                out.append(Result("persistent", f.rank, f.name, f.length, CORRUPT, str(e)))
            else:
                out.append(_compare("persistent", f.rank, f.name, f.length, got, f.checksum))
            bar.advance(task, f.length)
    finally:
        os.close(sink)
    return out


def _compare(tier: str, rank: int, name: str, length: int, got: str, want: str | None) -> Result:
    if got == want:
        return Result(tier, rank, name, length, OK)
    return Result(tier, rank, name, length, CORRUPT, f"checksum {got}, expected {want}")
