"""xxh3-128 of bytes at an address, hashed without the GIL whatever their length: the `xxhash`
package's own C function, called through :mod:`ctypes`.

Kept in bench/ only, for ``verify_threads.py``: the product used it for a few hours (issue 35)
and dropped it after a quiet 16-core host measured it slower over 2 to 16 threads than one
thread with xxhash's own call (each 64 KiB block hands the GIL over twice; docs/benchmarks.md).

python-xxhash releases the GIL only for inputs over 64 KiB (its ``_GIL_MINSIZE``), so the blocks
of every file of up to 64 MiB (at most 64 KiB each: ``integrity.block_size``) are hashed one
thread at a time however many threads take them. Its extension module exports the xxHash
library it is built with (``XXH3_128bits``, and ``XXH3_128bits_dispatch``, the AVX2/AVX-512 one
its own calls use where it was built with the dispatcher); a ``ctypes`` call releases the GIL
for the call's whole length. What holds the GIL is the call's own Python work (converting the
arguments, building the result: ~1 us) and the comparison; the hash itself (~2 us per 64 KiB in
the cache, ~10 us from memory) runs beside the other threads' hashes.

One thread hashes faster with xxhash's own call (no ctypes overhead): this is for several
threads sharing small blocks (``verified_copy.check_all``, ``copy_all``). The same function
gives the same digests, so nothing stored changes; :func:`hexdigest_at` is None where the
symbol is missing or its digests differ from xxhash's own (checked once, on first use).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import xxhash

HexAt = Callable[[int, int], str]
"""``hexdigest_at(address, length)``: the xxh3-128 hex digest of ``length`` bytes at
``address`` (as ``xxhash.xxh3_128_hexdigest`` gives it), computed without the GIL."""


class _Hash128(ctypes.Structure):
    # XXH128_hash_t: returned by value (two registers on x86-64 and arm64).
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


_SYMBOLS = ("XXH3_128bits_dispatch", "XXH3_128bits")
_LOCK = threading.Lock()
_FOUND: list[HexAt | None] = []


def hexdigest_at() -> HexAt | None:
    """The GIL-free digest function, or None where it cannot be had (module docstring)."""
    if not _FOUND:
        with _LOCK:
            if not _FOUND:
                _FOUND.append(_load())
    return _FOUND[0]


def _load() -> HexAt | None:
    ext = getattr(getattr(xxhash, "_xxhash", None), "__file__", None)
    if not ext:
        return None
    try:
        lib = ctypes.CDLL(ext)  # already loaded by the import: the same handle
    except OSError:
        return None
    for name in _SYMBOLS:
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = _Hash128

        def hexdigest(address: int, length: int, fn: Any = fn) -> str:
            # The struct's bytes are low64 then high64, each in the machine's order; the
            # digest is high64 then low64, big-endian: the bytes reversed on a little-endian
            # machine (on a big-endian one the self-check below fails, and xxhash's call is used).
            return bytes(fn(address, length))[::-1].hex()

        if _agrees(hexdigest):
            return hexdigest
    return None


def _agrees(hexdigest: HexAt) -> bool:
    """Whether ``hexdigest`` gives xxhash's digests (lengths around xxh3's internal branches)."""
    probe = bytearray(range(256)) * 1100  # 281,600 bytes
    view = memoryview(probe)
    base = address(view)
    if base is None:
        return False
    for n in (0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, 65536, 65537, len(probe) - 5):
        if hexdigest(base + 5 if n == len(probe) - 5 else base, n) != xxhash.xxh3_128_hexdigest(
            view[5 : 5 + n] if n == len(probe) - 5 else view[:n]
        ):
            return False
    return True


def address(view: memoryview) -> int | None:
    """The address of the first byte of contiguous buffer ``view`` (None: no way to take it:
    a read-only buffer where numpy is missing). Valid while the buffer's owner keeps it."""
    if not view.readonly:
        if not view.nbytes:
            return None
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    try:
        import numpy as np
    except ImportError:
        return None
    return int(np.frombuffer(view, np.uint8).ctypes.data)
