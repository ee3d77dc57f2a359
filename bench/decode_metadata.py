"""What the DCP metadata of a step costs the client: the coordinator encodes and packs it at save
(on the save's background thread), and every rank inflates, parses and decodes it whole at load
(DCP plans a load against every chunk of every tensor). The FSDP shape of bench/scale.py
(``--tensors`` tensors, each sharded over every rank); with the garbage collector running and
paused (the client pauses it: ``tierckpt_client.dcp._metadata_codec.metadata_text`` and ``metadata_from_text``).

    python bench/decode_metadata.py --ranks 64,256,1024 --tensors 200
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pydantic_core
from scale import fsdp_metadata_object
from torch.distributed.checkpoint.metadata import Metadata

from tierckpt_client.dcp._metadata_codec import decode_metadata, encode_metadata
from tierckpt_core.metadata_blob import pack_metadata, unpack_metadata


def timed(fn: Callable[[], object], repeat: int, *, paused: bool) -> float:
    """The median of ``repeat`` runs of ``fn``, seconds."""
    times = []
    for _ in range(repeat):
        gc.collect()
        if paused:
            gc.disable()
        try:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="64,256", help="comma-separated world sizes")
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    print(
        "| ranks | chunks | JSON | packed text | writer: encode + pack, GC on / paused "
        "| reader: inflate + parse + decode, GC on / paused | reader per chunk, paused |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for world in (int(x) for x in args.ranks.split(",")):
        md, _ = fsdp_metadata_object(world, args.tensors, 16 << 20)
        text = pack_metadata(encode_metadata(md))
        entries = world * args.tensors
        json_bytes = len(pydantic_core.to_json(encode_metadata(md)))

        def write(m: Metadata = md) -> str:
            return pack_metadata(encode_metadata(m))

        def read(t: str = text) -> Metadata:
            return decode_metadata(unpack_metadata(t, where="bench"))

        w_on, w_off = (timed(write, args.repeat, paused=x) for x in (False, True))
        r_on, r_off = (timed(read, args.repeat, paused=x) for x in (False, True))
        print(
            f"| {world} | {entries:,} | {json_bytes / 1e6:.2f} MB | {len(text) / 1e6:.2f} MB "
            f"| {w_on * 1e3:,.0f} / {w_off * 1e3:,.0f} ms | {r_on * 1e3:,.0f} / {r_off * 1e3:,.0f} ms "
            f"| {r_off / entries * 1e6:.1f} µs |"
        )


if __name__ == "__main__":
    main()
