"""What a rank pays to read a step's DCP metadata at load: inflate the text the daemons keep, parse
the JSON, decode it into DCP's ``Metadata`` (every rank does it whole: DCP plans a load against
every chunk of every tensor). The FSDP shape of bench/scale.py (``--tensors`` tensors, each
sharded over every rank); per chunk entry, with the garbage collector running and paused (the
reader pauses it: see ``tierckpt_client.dcp.reader._collection_paused``).

    python bench/decode_metadata.py --ranks 64,256,1024 --tensors 200
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import fsdp_metadata

from tierckpt_client.dcp._metadata_codec import decode_metadata
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
        "| ranks | chunks | packed text | inflate + parse, GC on / paused | decode, GC on / paused "
        "| per chunk, GC on / paused |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for world in (int(x) for x in args.ranks.split(",")):
        doc, _ = fsdp_metadata(world, args.tensors, 16 << 20)
        text = pack_metadata(doc)
        entries = world * args.tensors
        cells = []
        for paused in (False, True):
            parse = timed(partial(unpack_metadata, text, where="bench"), args.repeat, paused=paused)
            decode = timed(partial(decode_metadata, doc), args.repeat, paused=paused)
            cells.append((parse, decode))
        (p_on, d_on), (p_off, d_off) = cells
        print(
            f"| {world} | {entries} | {len(text) / 1e6:.2f} MB | {p_on * 1e3:.0f} / {p_off * 1e3:.0f} ms "
            f"| {d_on * 1e3:.0f} / {d_off * 1e3:.0f} ms "
            f"| {(p_on + d_on) / entries * 1e6:.1f} / {(p_off + d_off) / entries * 1e6:.1f} µs |"
        )


if __name__ == "__main__":
    main()
