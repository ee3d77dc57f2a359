"""Where a ``dcp.load`` through ``TieredStorageReader`` spends its time, phase by phase (issue 36:
the restore into CUDA tensors paid ~15-25 ms per load beyond the H2D copy).

:class:`RestorePhases` wraps the functions of the load's path (nothing in the product changes)
and, inside :meth:`RestorePhases.measure`, adds up the wall time spent in each:

- ``metadata``: ``read_metadata`` (the plan, a round trip to the daemon, the metadata decoded);
- ``open``: the memory source's ``open_files`` up to the files handed over (the pin, a round
  trip; the files other nodes hold brought here);
- ``map``: ``_arena.map_file`` (a cached mapping: an ``open`` and ``fstat``; a new one: the
  mapping and its page faults; ``new_mappings`` counts them);
- ``register``: ``cudaHostRegister`` calls (``registrations`` counts them: 0 once warm);
- ``device``: the device copies of the load (``_device_copy.land``), of which ``verify``: in
  ``check_all`` on the caller's thread (its share of the blocks, then waiting for the helpers)
  and ``sync``: waiting for the side streams after the check (the DMA still running);
  ``launch``: the rest of ``device`` (the copies queued, the blocks listed);
- ``close``: the files closed and the unpin sent;
- ``rest``: what the load took beyond these (DCP's planning, bytes items, the commit).

The wrappers cost a few microseconds per call: they stay installed for the timed loads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

Phases = dict[str, float]
KEYS = (
    "metadata",
    "open",
    "map",
    "register",
    "launch",
    "verify",
    "sync",
    "device",
    "close",
    "rest",
    "total",
)


class RestorePhases:
    def __init__(self) -> None:
        self.active = False
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    # -- recording -----------------------------------------------------------------------------
    def _add(self, key: str, since: float) -> None:
        if self.active:
            self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - since

    def _count(self, key: str) -> None:
        if self.active:
            self.n[key] = self.n.get(key, 0) + 1

    def _wrap(self, owner: Any, name: str, key: str, *, count: str | None = None) -> None:
        orig = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self._add(key, t)
                if count:
                    self._count(count)

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, orig))

    def install(self) -> RestorePhases:
        """Wrap the load's path (see the module docstring); :meth:`uninstall` undoes it."""
        import torch

        from tierckpt_client.dcp import TieredStorageReader, _arena, _device_copy
        from tierckpt_client.dcp.sources import files, memory

        self._wrap(TieredStorageReader, "read_metadata", "metadata")
        self._wrap(_arena, "map_file", "map")
        self._wrap(_arena, "_new_mapping", "map_new", count="new_mappings")
        self._wrap(_arena, "_cuda_host_register", "register", count="registrations")
        self._wrap(files, "land_on_device", "device")  # files' name for _device_copy.land
        self._wrap(_device_copy, "check_all", "verify")
        stream = torch.cuda.Stream  # (a stand-in where there is no CUDA: the wiring test's)
        if hasattr(stream, "synchronize"):
            self._wrap(stream, "synchronize", "sync")
        orig_open = memory.MemorySource.open_files
        phases = self

        @contextlib.contextmanager
        def open_files(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
            t = time.perf_counter()
            cm = orig_open(self, *args, **kwargs)
            got = cm.__enter__()
            phases._add("open", t)
            try:
                yield got
            except BaseException as e:
                t = time.perf_counter()
                try:
                    if not cm.__exit__(type(e), e, e.__traceback__):
                        raise
                finally:
                    phases._add("close", t)
            else:
                t = time.perf_counter()
                try:
                    cm.__exit__(None, None, None)
                finally:
                    phases._add("close", t)

        memory.MemorySource.open_files = open_files  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(memory.MemorySource, "open_files", orig_open))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    @contextlib.contextmanager
    def measure(self) -> Iterator[Phases]:
        """Record one load: the dict yielded is filled with its phases (s) when the block ends."""
        out: Phases = {}
        self.t, self.n, self.active = {}, {}, True
        t0 = time.perf_counter()
        try:
            yield out
        finally:
            total = time.perf_counter() - t0
            self.active = False
            t = self.t
            map_s = t.get("map", 0.0)
            register = t.get("register", 0.0)
            verify, sync, device = t.get("verify", 0.0), t.get("sync", 0.0), t.get("device", 0.0)
            out.update(
                metadata=t.get("metadata", 0.0),
                open=t.get("open", 0.0),
                map=map_s,  # the files' buffers, first asked for between open and device
                register=register,
                launch=max(0.0, device - verify - sync - register),
                verify=verify,
                sync=sync,
                device=device,
                close=t.get("close", 0.0),
                total=total,
            )
            inside = out["metadata"] + out["open"] + map_s + device + out["close"]
            out["rest"] = max(0.0, total - inside)
            out["new_mappings"] = float(self.n.get("new_mappings", 0))
            out["registrations"] = float(self.n.get("registrations", 0))


def summary(runs: list[Phases]) -> dict[str, Any]:
    """Median ms per phase over ``runs``, and each run's phases (ms)."""
    import statistics

    if not runs:
        return {}
    keys = [k for k in runs[0] if k in KEYS]
    return {
        "median_ms": {k: statistics.median(r[k] for r in runs) * 1e3 for k in keys},
        "new_mappings": [int(r.get("new_mappings", 0)) for r in runs],
        "registrations": [int(r.get("registrations", 0)) for r in runs],
        "iters_ms": [{k: round(r[k] * 1e3, 3) for k in keys} for r in runs],
    }


def line(s: dict[str, Any]) -> str:
    """One printed line of :func:`summary`."""
    if not s:
        return "no restore measured"
    med = s["median_ms"]
    return (
        ", ".join(f"{k} {med[k]:.2f}" for k in KEYS if k in med)
        + f" ms (medians); new mappings {s['new_mappings']}, registrations {s['registrations']}"
    )
