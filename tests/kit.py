"""The tests' shared kit for one-rank saves and loads: state dicts to save, blank destinations of
the same structure, and a save or load through the tiered writer and reader on this process (no
process group), or one rank's file sealed straight through the daemon's API (``seal_bytes``).
Daemons come from :mod:`helpers` (``started``) and the fixtures of ``tests/conftest.py``
(``make_node``, ``make_ring``); gloo ranks from ``helpers.run_ranks``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlanner

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.protocol import SealFile

from helpers import DaemonProcess, wait_until

__all__ = [
    "CLI",
    "blank_like",
    "blank_state",
    "cli",
    "cli_json",
    "client_config",
    "load",
    "reader",
    "save",
    "seal_bytes",
    "seeded_state",
    "step_states",
    "wait_durable",
]


def seeded_state(
    step: int,
    numel: int,
    *,
    seed: int | None = None,
    more: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    **meta: Any,
) -> dict[str, Any]:
    """``{"w": numel random floats, "meta": {"step": step, **meta}}``, the same for the same
    ``seed`` (``step`` by default): what a test saves, and what it expects back. ``more`` adds
    tensors ``name: (shape, dtype)``, drawn after ``w`` from the same generator in that order:
    normal floats converted to ``dtype``, or integers in [0, 2**30) for an integer dtype."""
    g = torch.Generator().manual_seed(step if seed is None else seed)
    out: dict[str, Any] = {"w": torch.randn(numel, generator=g)}
    for name, (shape, dtype) in (more or {}).items():
        if dtype.is_floating_point:
            out[name] = torch.randn(*shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(0, 1 << 30, shape, generator=g).to(dtype)
    out["meta"] = {"step": step, **meta}
    return out


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    """A destination for loading ``state``: the same keys, zeroed tensors of the same shapes and
    dtypes, and ``-1`` where ``state`` holds anything else (a load replaces those whole)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        elif isinstance(value, dict):
            out[key] = blank_like(value)
        else:
            out[key] = -1
    return out


def blank_state(numel: int, **meta: Any) -> dict[str, Any]:
    """A destination for a :func:`seeded_state` of ``numel`` floats and these ``meta`` keys."""
    return blank_like(seeded_state(0, numel, **meta))


def client_config(
    node: DaemonProcess | None, config: ClientConfig | None = None
) -> ClientConfig | None:
    """``config`` if given, else one that reaches ``node``, else None (``TIERCKPT_SOCKET`` from
    the environment, as a trainer's would)."""
    if config is not None:
        return config
    return ClientConfig.from_env(socket=node.socket) if node is not None else None


def save(
    ns: str,
    step: int,
    state: dict[str, Any],
    *,
    node: DaemonProcess | None = None,
    config: ClientConfig | None = None,
    staged: bool = True,
    **writer: Any,
) -> TieredStorageWriter:
    """Save ``state`` as ``ns``/``step`` on one rank: staged (``async_save``, which copies into
    the leased files, then waits for the commit) or, with ``staged=False``, a plain ``dcp.save``
    (``write_data`` copies). ``writer`` goes to :class:`TieredStorageWriter` (``persist=...``)."""
    w = TieredStorageWriter(ns, step, config=client_config(node, config), **writer)
    if staged:
        dcp.async_save(state, storage_writer=w, no_dist=True).result()
    else:
        dcp.save(state, storage_writer=w, no_dist=True)
    return w


def reader(
    ns: str,
    dest: dict[str, Any],
    step: int | None = None,
    *,
    node: DaemonProcess | None = None,
    config: ClientConfig | None = None,
    planner: LoadPlanner | None = None,
) -> TieredStorageReader:
    """Load ``ns``/``step`` (the latest if None) into ``dest`` on one rank, and return the reader
    (which step it read, ``resolved_step``, and from where)."""
    r = TieredStorageReader(ns, step, config=client_config(node, config))
    dcp.load(dest, storage_reader=r, planner=planner, no_dist=True)
    return r


def load(
    ns: str,
    dest: dict[str, Any],
    step: int | None = None,
    *,
    node: DaemonProcess | None = None,
    config: ClientConfig | None = None,
    planner: LoadPlanner | None = None,
) -> tuple[int | None, dict[str, Any]]:
    """Load ``ns``/``step`` (the latest if None) into ``dest`` on one rank: the step read, and
    ``dest``."""
    r = reader(ns, dest, step, node=node, config=config, planner=planner)
    return r.resolved_step, dest


def seal_bytes(
    node: DaemonProcess, ns: str, step: int, attempt: str, rank: int, size: int
) -> tuple[str, bytes]:
    """One rank's part of a save without the writer: lease ``size`` bytes on ``node``, write
    random bytes into the leased file and seal it as ``r{rank:05d}.data`` in ``ns``/``step``'s
    ``attempt`` (the commit is the caller's). Returns the file's name and its bytes."""
    data = os.urandom(size)
    name = f"r{rank:05d}.data"
    with DaemonClient.from_socket(node.socket) as c:
        lease = c.lease(ns, rank, len(data))
        with open(lease.path, "r+b") as f:
            f.write(data)
        c.seal(ns, step, attempt, rank, [SealFile(lease_id=lease.lease_id, name=name, length=size)])
    return name, data


def step_paths(ns: str, step: int) -> dict[str, str]:
    """The paths of a committed step's files in the tier directory of this process's daemon
    (``TIERCKPT_SOCKET``), as a pin shows them."""
    with DaemonClient() as c:
        pin = c.pin(ns, step)
        c.unpin(ns, step, pin.pin_id)
    return pin.paths


def flip_byte(path: str | os.PathLike[str], offset: int, mask: int = 0x01) -> None:
    """Damage one stored byte in place (XOR with ``mask``), as a bad disk or a stray writer
    would: what a verified read must catch."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))


def step_states(ns: str, *, node: DaemonProcess | None = None) -> dict[int, str]:
    """``{step: state}`` of every step ``node`` (this process's daemon if None) lists in ``ns``."""
    with DaemonClient(client_config(node)) as c:
        return {s.step: s.state.value for s in c.steps(ns)}


def wait_durable(
    ns: str | list[str],
    steps: int | set[int] | None = None,
    *,
    node: DaemonProcess | None = None,
    timeout: float = 60.0,
) -> None:
    """Wait (polling) until these ``steps`` of ``ns`` are listed and durable on ``node`` (this
    process's daemon if None); with ``steps`` None, until ``ns`` (or each namespace of a list)
    lists a step and every step it lists is durable. Fails after ``timeout`` seconds naming the
    states seen and the persistent tier's status."""
    spaces = [ns] if isinstance(ns, str) else list(ns)
    want = {steps} if isinstance(steps, int) else steps
    with DaemonClient(client_config(node)) as c:

        def states() -> dict[str, dict[int, str]]:
            return {n: {s.step: s.state.value for s in c.steps(n)} for n in spaces}

        def durable() -> bool:
            for seen in states().values():
                wanted = want if want is not None else set(seen)
                if not wanted or any(seen.get(s) != "durable" for s in wanted):
                    return False
            return True

        wait_until(
            f"{spaces} steps {sorted(want) if want is not None else 'all'} durable",
            durable,
            timeout,
            describe=lambda: f"states {states()}; persistent: {c.status().persistent}",
        )


CLI = [sys.executable, "-m", "tierckpt_client.cli"]


def cli(
    *args: str,
    node: DaemonProcess | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> subprocess.CompletedProcess[str]:
    """Run the ``tierckpt`` command as a user would (a process of its own; this process's
    environment, ``TIERCKPT_SOCKET`` set to ``node``'s daemon (or a socket path) if given, then
    ``env``); a run past ``timeout`` fails the test."""
    where = {}
    if node is not None:
        sock = node.socket if isinstance(node, DaemonProcess) else node
        where = {"TIERCKPT_SOCKET": os.fspath(sock)}
    return subprocess.run(
        [*CLI, *args],
        env={**os.environ, **where, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli_json(
    *args: str,
    node: DaemonProcess | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    """:func:`cli` with ``--json`` after ``args``: it must exit 0; its output, parsed."""
    proc = cli(*args, "--json", node=node, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# -- DTensor states (FSDP2, HSDP) on a mesh of the ranks ----------------------------------------


def dtensor_meshes(world: int) -> list[tuple[str, Any, list[Any]]]:
    """FSDP2's layout (``Shard(0)`` over the ranks) and HSDP's (``Replicate`` over ``world``
    replica groups of one shard each), as (name, mesh, placements); call in every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    flat = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    return [("fsdp", flat, [Shard(0)]), ("hsdp", hsdp, [Replicate(), Shard(0)])]


DTENSOR_KEYS = ("w", "b", "one", "w2", "p")


def dtensor_state(mesh: Any, placements: Any, seed: int) -> dict[str, Any]:
    """A state of ``DTensor``s on ``mesh`` (:data:`DTENSOR_KEYS`, an uneven one and one with an
    empty shard on the second rank, two of one shape, a parameter) and ``nested.m``, beside a
    plain tensor and a value; the same values on every rank for a ``seed``."""
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(seed)
    full = {
        "w": torch.randn(6, 4, generator=g),
        "b": torch.randn(5, generator=g),  # uneven: 3 and 2 rows
        "one": torch.randn(1, 3, generator=g),  # one rank's shard is empty
        "w2": torch.randn(6, 4, generator=g).to(torch.bfloat16),  # a shape met before
        "p": torch.randn(8, generator=g),
    }
    sd: dict[str, Any] = {k: distribute_tensor(v, mesh, placements) for k, v in full.items()}
    sd["p"] = torch.nn.Parameter(sd["p"])  # as FSDP2's parameters are: requires_grad
    sd["plain"] = torch.arange(4.0)
    sd["nested"] = {"m": distribute_tensor(torch.randn(6, 4, generator=g), mesh, placements)}
    sd["step"] = seed
    return sd
