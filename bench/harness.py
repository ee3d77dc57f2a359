"""The benchmark suite's harness: what every scenario shares (run as ``python bench/<script>.py``).

- the machine and the results file: :func:`machine_info`, :func:`write_results`, :func:`add_rates`;
- CPU accounting from /proc: :func:`cpu_s`, :func:`system_cpu`, :func:`busy_cores`;
- the state to save: :func:`make_state` (the one state builder), :func:`mutate`, :func:`tensors`,
  :func:`zeros_like_state`, :func:`check_equal`, and :func:`victim` (the training loop);
- paired timing: :func:`memcpy` (the baseline, timed right before what it is compared with) and
  :func:`paired_ratio`;
- one daemon: :func:`start_daemon` (a real daemon on its own tmpfs dir and Unix socket), and
  :func:`running_daemon` for a ``with`` block;
- the suite (``run_all.py``): :func:`run_child` and :func:`child_results` run a scenario as a child
  process, :data:`Row` and :func:`table` render the rows every scenario's ``rows()`` returns,
  :func:`plot_throughput` draws the plot.

A scenario module (``memory_tier.py``, ``stall.py``, ...) keeps its own command line; for the suite
it has ``run(args, tmp, notes)`` (run itself as a child, return its results or ``None`` with a
note) and ``rows(results)`` (its rows of the suite's table, from all the suite's results).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tierckpt_core.launcher import (
    DaemonProcess,
    free_port,  # noqa: F401 (the benches' one port picker)
    new_shm_dir,
)

BENCH = Path(__file__).resolve().parent
N_TENSORS = 16  # the state's tensors unless a scenario says otherwise


def machine_info(**extra: Any) -> dict[str, Any]:
    """The machine and software versions, plus the run's own settings (``extra``)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cores": len(os.sched_getaffinity(0)),
        "mem_gib": round(mem / (1 << 30), 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        **extra,
    }


def add_rates(res: dict[str, Any], keys: Iterable[str]) -> None:
    """For each row ``res[key]`` with seconds ``s`` and ``bytes``: its median and MB/s (10^6)."""
    for key in keys:
        if key in res:
            r = res[key]
            r["median_s"] = statistics.median(r["s"])
            r["mbps"] = r["bytes"] / r["median_s"] / 1e6


def write_results(path: Path, info: dict[str, Any], res: dict[str, Any]) -> None:
    """The run's JSON: the machine and settings, and every result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": info, "results": res}, indent=2) + "\n")
    print(f"results written to {path}")


# -- CPU accounting -----------------------------------------------------------------------------


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) of a process; ``None`` = this one."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def system_cpu() -> list[int]:
    """The machine's CPU jiffies from /proc/stat: user nice system idle iowait irq softirq steal."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]


def busy_cores(a: list[int], b: list[int]) -> float:
    """Average cores busy between two system_cpu() samples (all but idle and iowait)."""
    d = [y - x for x, y in zip(a, b, strict=True)]
    total = sum(d) or 1
    return (total - d[3] - d[4]) / total * len(os.sched_getaffinity(0))


def steal_cores(a: list[int], b: list[int]) -> float:
    d = [y - x for x, y in zip(a, b, strict=True)]
    return d[7] / (sum(d) or 1) * len(os.sched_getaffinity(0))


# -- the state to save, and a training loop to measure beside -----------------------------------

MM_SIZE = 512
EXTRA = {"step": 0, "lr": 3e-4, "tag": "bench"}  # a non-tensor item, as a trainer's state has


def make_state(
    size_mb: float,
    n: int = N_TENSORS,
    *,
    name: str = "w{i:02d}",
    seed: int = 0,
    extra: Mapping[str, Any] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """``size_mb`` MiB of float32 in ``n`` equal tensors named ``name.format(i=i)``, from a
    generator seeded with ``seed`` (the same state on every rank unless the seed differs); with
    ``extra``, a copy of it under the key ``"extra"``."""
    numel = int(size_mb * (1 << 20)) // n // 4
    gen = torch.Generator(device=device).manual_seed(seed)
    sd: dict[str, Any] = {
        name.format(i=i): torch.randn(numel, generator=gen, device=device) for i in range(n)
    }
    if extra is not None:
        sd["extra"] = dict(extra)
    return sd


def tensors(sd: dict[str, Any]) -> list[torch.Tensor]:
    return [v for v in sd.values() if isinstance(v, torch.Tensor)]


def mutate(sd: dict[str, Any]) -> None:
    """A new step: every tensor changes (one element), and the extra item's ``step``."""
    for t in tensors(sd):
        t[0] += 1
    if "extra" in sd:
        sd["extra"]["step"] += 1


def zeros_like_state(sd: dict[str, Any]) -> dict[str, Any]:
    """A destination to load into: zeroed tensors, and an extra item unlike the saved one."""
    out: dict[str, Any] = {k: torch.zeros_like(v) for k, v in sd.items() if k != "extra"}
    if "extra" in sd:
        out["extra"] = {k: type(v)() for k, v in sd["extra"].items()} | {"step": -1}
    return out


def check_equal(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    bad = [k for k, v in want.items() if k != "extra" and not torch.equal(got[k], v)]
    if bad or got.get("extra") != want.get("extra"):
        raise AssertionError(f"{what}: loaded state differs from the saved one ({bad or 'extra'})")


def victim(a: torch.Tensor, b: torch.Tensor, steps: int) -> None:
    """The 'training loop': single-threaded 512x512 matmuls."""
    c = torch.empty_like(a)
    for _ in range(steps):
        torch.mm(a, b, out=c)
        a, c = c.mul_(1e-3), a


# -- paired timing ------------------------------------------------------------------------------


def memcpy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> float:
    """Seconds to copy ``src`` into ``dst``: the baseline, timed right before what it pairs with."""
    t0 = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
    return time.perf_counter() - t0


def paired_ratio(times: list[float], base: list[float], warmup: int, best: bool = False) -> float:
    """Median (``best``: minimum) over the steady iterations of (time / the memcpy measured right
    before it). Noise on a shared machine only ever adds time, so the minimum is the estimate of
    what the save costs on a quiet one; the median is what this run saw."""
    r = [t / b for t, b in zip(times[warmup:], base[warmup:], strict=True)]
    return min(r) if best else statistics.median(r)


# -- one daemon ---------------------------------------------------------------------------------


def start_daemon(
    capacity_mb: int,
    *,
    keep_last: int = 2,
    shm_dir: Path | None = None,
    log_path: Path | None = None,
    set_env: bool = True,
    log_level: str = "WARNING",
    **settings: Any,
) -> DaemonProcess:
    """A real daemon with ``capacity_mb`` MiB of memory tier on its own tmpfs dir (a new one under
    /dev/shm unless ``shm_dir``) and Unix socket, started. With ``set_env``, ``TIERCKPT_SOCKET``
    names it for this process and its children. ``settings`` are the daemon's own (``port``,
    ``peers``, ...). Stop it with ``stop()``, or ``cleanup()`` to remove its dir as well."""
    daemon = DaemonProcess(
        shm_dir or new_shm_dir("tierckpt-bench"),
        log_path=log_path,
        capacity=f"{capacity_mb}M",
        keep_last=keep_last,
        log_level=log_level,
        **settings,
    ).start()
    if set_env:
        os.environ["TIERCKPT_SOCKET"] = str(daemon.socket)
    return daemon


@contextlib.contextmanager
def running_daemon(capacity_mb: int, **kw: Any) -> Iterator[DaemonProcess]:
    """:func:`start_daemon` for a ``with`` block: its log's tail on stderr if the block fails,
    the daemon stopped and its dir removed on the way out."""
    daemon = start_daemon(capacity_mb, **kw)
    try:
        yield daemon
    except BaseException:
        print(f"daemon log (tail):\n{daemon.log()}", file=sys.stderr)
        raise
    finally:
        daemon.cleanup()


# -- the suite: children, rows, plot ------------------------------------------------------------

Row = tuple[str, str, str, str, str, str, str]  # size, measurement, value, GB/s, ratio, target, met


def yes(ok: bool) -> str:
    return "yes" if ok else "**NO**"


def run_child(cmd: list[str], what: str, timeout: float = 3600) -> None:
    """Run a scenario; its own output goes to a log, shown only if it fails."""
    t0 = time.perf_counter()
    print(f"- {what} ...", end=" ", flush=True)
    with tempfile.TemporaryFile() as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        if rc != 0:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-4000:]
            print(f"FAILED (exit {rc})")
            raise RuntimeError(f"{what} failed (exit {rc}):\n{tail}")
    print(f"{time.perf_counter() - t0:.0f} s", flush=True)


def child_results(
    script: str,
    args: list[str],
    out: Path,
    what: str,
    notes: list[str],
    skipped: str = "",
    required: bool = False,
) -> Any:
    """Run ``bench/<script> <args> --out <out>`` (its flag for the JSON may differ: then pass it
    in ``args`` and ``out`` alone) and return its JSON; ``None`` with a note (``skipped`` names
    what, ``what`` by default) if it failed, or with ``required`` the failure itself."""
    cmd = [sys.executable, str(BENCH / script), *args]
    if str(out) not in args:
        cmd += ["--out", str(out)]
    try:
        run_child(cmd, what)
        return json.loads(out.read_text())
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        if required:
            raise
        notes.append(f"{skipped or what} skipped: {str(e).strip().splitlines()[-1][:300]}")
        return None


def sized_child(
    script: str, what: str, suite: Any, skip: str, size: str, tmp: Path, notes: list[str]
) -> dict[str, Any] | None:
    """A scenario that takes ``--smoke`` or ``--size-mb`` and writes ``{"machine": {"size_mb":
    ...}, "results": ...}``, run for the suite (its options ``suite``): ``None`` with a note if
    ``suite.<skip>`` is set (``--no-...``) or the run failed, else its results with ``size_mb``.
    ``suite.<size>``: its ``--size-mb`` (its own default if unset)."""
    if getattr(suite, skip):
        notes.append(f"{what} skipped (--{skip.replace('_', '-')})")
        return None
    size_mb = getattr(suite, size)
    args = ["--smoke"] if suite.smoke else ["--size-mb", str(size_mb)] if size_mb else []
    out = tmp / f"{Path(script).stem}.json"
    d = child_results(script, args, out, what, notes)
    return None if d is None else {"size_mb": d["machine"]["size_mb"], **d["results"]}


def table(rows: list[Row]) -> str:
    lines = [
        "| size | measurement | value (steady median) | GB/s | ratio | target | met |",
        "|---:|---|---:|---:|---|---|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def plot_throughput(
    sizes: list[int], lines: dict[str, list[float]], title: str, xlabel: str, path: Path
) -> None:
    """GB/s against the state size (MiB, log 2), one line per label: the suite's plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.5))
    styles = ["o-", "s-", "^-", "k--", "v:", "d:"]
    for (label, gbps), style in zip(lines.items(), styles, strict=True):
        ax.plot(sizes, gbps, style, label=label, linewidth=2, markersize=6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ticks = [t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if lo <= t <= hi]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xticks(sizes, [f"{s} MiB" if s < 1024 else f"{s // 1024} GiB" for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel(xlabel)
    ax.set_ylabel("throughput, GB/s (10^9 B/s, steady median; log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
