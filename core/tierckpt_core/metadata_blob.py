"""A step's DCP metadata as the daemons keep it: opaque text, hashed, never parsed.

The writer encodes the metadata (the JSON form of :mod:`tierckpt_client.dcp._metadata_codec`)
once, compressed: ``"zlib+b64:" + base64(zlib(JSON))``. That text is what travels from the writer
to its daemon, from the decider to the metadata's holders, into ``MANIFEST.json`` and the
persistent tier's ``manifest.json``, and to every reader; its digest (:func:`metadata_digest`) is
taken over the text itself. No daemon decodes it on the commit path: parsing, re-encoding and
hashing the JSON was the decider's CPU term that grew with the job (docs/scale.md). Readers
decode it (:func:`unpack_metadata`) and treat it as untrusted input.

Records written before this (and clients that send the metadata as a JSON object) hold the JSON
object itself; it is kept as its canonical JSON text (sorted keys, no spaces), whose digest is the
one those records were committed with, so that their holders' copies still check out.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import zlib
from typing import Annotated, Any

import pydantic_core
from pydantic import AfterValidator, BeforeValidator

from tierckpt_core.errors import CheckpointFormatError

PREFIX = "zlib+b64:"
# What a reader inflates at most (a sanity bound against a crafted blob: the DCP metadata of a
# 2,000-node job is ~1 GB of JSON).
MAX_INFLATED_BYTES = 4 << 30


def canonical_json(doc: Any) -> str:
    """The canonical JSON text of ``doc``: what record digests have been taken over."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def pack_metadata(doc: dict[str, Any]) -> str:
    """The metadata's JSON form as the daemons keep it (compressed, then base64: about 1/10 to
    1/40 of the JSON for DCP metadata, whose keys and offsets repeat)."""
    raw = pydantic_core.to_json(doc)  # compact; 2-3x json.dumps's speed (docs/scale.md)
    return PREFIX + base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def _as_text(value: Any) -> Any:
    # A JSON object (a record of an earlier format, a client that sends one): its canonical text.
    # An empty one is the "kept elsewhere" of earlier records: the empty text.
    if isinstance(value, dict):
        return canonical_json(value) if value else ""
    return value


# The type of every ``metadata`` field of a record or a message.
MetadataText = Annotated[str, BeforeValidator(_as_text)]


def _sent_as_text(value: Any) -> Any:
    return canonical_json(value) if isinstance(value, dict) else value


def _well_formed(text: str) -> str:
    if not (text.startswith(PREFIX) or text.startswith("{")):
        raise ValueError(
            f"must be {PREFIX!r} text (tierckpt_core.metadata_blob.pack_metadata) or a JSON "
            f"object, not {text[:40]!r}"
        )
    return text


# The metadata of a commit request: as a writer packs it, or a JSON object (a client from
# before); anything else is refused at commit rather than at the first load.
SentMetadata = Annotated[str, BeforeValidator(_sent_as_text), AfterValidator(_well_formed)]


def metadata_digest(text: str) -> str:
    """The digest of a step's metadata as kept (what a node that does not keep it checks a copy
    fetched from one that does against)."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def unpack_metadata(text: str | dict[str, Any], *, where: str) -> dict[str, Any]:
    """The JSON form of the metadata kept as ``text`` (untrusted input): CheckpointFormatError
    naming ``where`` for anything that is not an encoded JSON object."""
    if isinstance(text, dict):
        return text
    if text.startswith(PREFIX):
        try:
            packed = base64.b64decode(text[len(PREFIX) :], validate=True)
            inflater = zlib.decompressobj()
            raw = inflater.decompress(packed, MAX_INFLATED_BYTES)
        except (binascii.Error, ValueError, zlib.error) as e:
            raise CheckpointFormatError(
                f"{where}: the step's metadata is not readable: {e}"
            ) from None
        if inflater.unconsumed_tail or not inflater.eof:
            raise CheckpointFormatError(
                f"{where}: the step's metadata is truncated or inflates past "
                f"{MAX_INFLATED_BYTES} bytes"
            )
    elif text.startswith("{"):
        raw = text.encode()
    elif not text:
        raise CheckpointFormatError(f"{where}: this copy of the step keeps no metadata")
    else:
        raise CheckpointFormatError(
            f"{where}: the step's metadata is neither {PREFIX!r} text nor a JSON object"
        )
    try:
        doc = pydantic_core.from_json(raw)  # ~1.5x json.loads's speed
    except ValueError as e:
        raise CheckpointFormatError(f"{where}: the step's metadata is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{where}: the step's metadata is not a JSON object")
    return doc
