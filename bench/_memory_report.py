"""``memory_tier.py``'s figures: its ratios, its own table, and its rows, fixed cost and plot in
the suite's (``run_all.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import Row, plot_throughput, yes


def ratios(ms: dict[str, float], paired: dict[str, float]) -> dict[str, float]:
    return {
        # Stall and time-to-committed: against the memcpy timed right before each save (paired),
        # so that the machine's drift over the run (and in PROCESS mode the helper process, whose
        # mere presence slows this process's copies ~30% here) hits both sides alike.
        "tier_blocking_over_memcpy": paired["tier_blocking_over_memcpy"],
        "tier_committed_over_memcpy": paired["tier_committed_over_memcpy"],
        "tier_blocking_over_memcpy_best": paired["tier_blocking_over_memcpy_best"],
        "tier_committed_over_memcpy_best": paired["tier_committed_over_memcpy_best"],
        "torch_blocking_over_tier_blocking": ms["torch_blocking"] / ms["tier_blocking"],
        # What async_save itself costs around the copy, with no storage at all (paired too).
        "floor_blocking_over_memcpy": paired["floor_blocking_over_memcpy"],
        "floor_committed_over_memcpy": paired["floor_committed_over_memcpy"],
        # Restore bandwidth over the paired memcpy's (median and best over the restores).
        "tier_restore_over_memcpy": paired["tier_restore_over_memcpy"],
        "tier_restore_over_memcpy_best": paired["tier_restore_over_memcpy_best"],
        "tier_restore_unverified_over_memcpy": paired["tier_restore_unverified_over_memcpy"],
        "tier_restore_over_fs_restore": ms["restore_fs"] / ms["restore_tier"],
        "tier_restore_verified_over_unverified": ms["restore_tier"] / ms["restore_tier_unverified"],
    }


TARGETS = {  # key: (label, target, met?) -- issue 5's goals
    "tier_blocking_over_memcpy": ("tierckpt stall / memcpy", "<= 1.3", lambda r: r <= 1.3),
    "tier_committed_over_memcpy": (
        "tierckpt time-to-committed / memcpy",
        "<= 1.5",
        lambda r: r <= 1.5,
    ),
    "tier_blocking_over_memcpy_best": (
        "tierckpt stall / memcpy, best iteration",
        "-",
        lambda r: True,
    ),
    "tier_committed_over_memcpy_best": (
        "tierckpt time-to-committed / memcpy, best iteration",
        "-",
        lambda r: True,
    ),
    "floor_blocking_over_memcpy": ("DCP floor stall / memcpy (no target)", "-", lambda r: True),
    "floor_committed_over_memcpy": (
        "DCP floor time-to-committed / memcpy (no target)",
        "-",
        lambda r: True,
    ),
    "torch_blocking_over_tier_blocking": ("torch stall / tierckpt stall", ">= 3", lambda r: r >= 3),
    "tier_restore_over_memcpy": (
        "tierckpt restore GB/s / paired memcpy GB/s (verified)",
        ">= 0.9 (issue 24; 0.7 at least)",
        lambda r: r >= 0.9,
    ),
    "tier_restore_over_memcpy_best": (
        "tierckpt restore GB/s / paired memcpy GB/s, best restore",
        "-",
        lambda r: True,
    ),
    "tier_restore_unverified_over_memcpy": (
        "restore GB/s / paired memcpy GB/s, TIERCKPT_VERIFY_READS=0 (no target)",
        "-",
        lambda r: True,
    ),
    "tier_restore_over_fs_restore": ("tierckpt / FS restore GB/s", ">= 5", lambda r: r >= 5),
    "tier_restore_verified_over_unverified": (
        "restore time, verified / TIERCKPT_VERIFY_READS=0 (no target)",
        "-",
        lambda r: True,
    ),
}
ROWS = {
    "memcpy": "(a) memcpy into pre-touched tensors",
    "memcpy_late": "(a) memcpy again, after the saves (DCP's helper process alive in PROCESS mode)",
    "torch_memcpy": "(a) memcpy right before each torch save (paired)",
    "torch_blocking": "(b) torch default: blocking",
    "torch_committed": "(b) torch default: time-to-committed",
    "floor_memcpy": "(a) memcpy right before each DCP-floor save (paired)",
    "floor_blocking": "(e) DCP floor (memcpy stager, no storage): blocking",
    "floor_committed": "(e) DCP floor: time-to-committed",
    "tier_memcpy": "(a) memcpy right before each tierckpt save (paired)",
    "tier_blocking": "(c) tierckpt: blocking",
    "tier_committed": "(c) tierckpt: time-to-committed",
    "restore_fs": "(d) restore: FileSystemReader",
    "restore_memcpy": "(a) memcpy right before each tierckpt restore (paired)",
    "restore_tier": "(d) restore: TieredStorageReader",
    "restore_tier_unverified": "(d) restore: TieredStorageReader, TIERCKPT_VERIFY_READS=0",
}


def render(res: dict[str, Any]) -> str:
    lines = [
        "| measurement | cold ms | steady ms | steady GB/s | all iterations ms |",
        "|---|---:|---:|---:|---|",
    ]
    for key, label in ROWS.items():
        r = res[key]
        runs = ", ".join(f"{t:.0f}" for t in r["all_ms"])
        lines.append(
            f"| {label} | {r['cold_ms']:.1f} | {r['steady_ms']:.1f} | {r['steady_gbps']:.2f} | {runs} |"
        )
    recycled = "".join("R" if x else "n" for x in res["tier_blocking"]["recycled"])
    lines += [
        "",
        f"tierckpt leases recycled per iteration: {recycled} (R = from the pool); steady = "
        f"median of iterations {res['warmup'] + 1}..{len(recycled)} (the first "
        f"{res['warmup']} are the ramp-up: fresh tmpfs pages), restores: all but the first",
        "",
        "| ratio | value | target | met |",
        "|---|---:|---|---|",
    ]
    for key, (label, target, ok) in TARGETS.items():
        v = res["ratios"][key]
        lines.append(f"| {label} | {v:.2f} | {target} | {'yes' if ok(v) else 'NO'} |")
    return "\n".join(lines)


def rows(res: dict[str, Any]) -> list[Row]:
    """The suite's rows: each size's."""
    return [row for size, r in res.get("memory_tier", {}).items() for row in size_rows(size, r)]


def size_rows(size: str, r: dict[str, Any]) -> list[Row]:
    nbytes = r["bytes"]
    ms = {k: v["steady_ms"] for k, v in r.items() if isinstance(v, dict) and "steady_ms" in v}
    memcpy = min(ms["memcpy"], ms["memcpy_late"])  # the floor: the faster of the two runs
    q = r["ratios"]
    rows: list[Row] = []

    def row(label: str, t_ms: float, ratio: str = "", target: str = "", met: str = "") -> None:
        gbps = nbytes / (t_ms / 1e3) / 1e9
        rows.append((f"{size} MiB", label, f"{t_ms:.1f} ms", f"{gbps:.2f}", ratio, target, met))

    row("memcpy into pre-touched tensors (faster of 2 runs)", memcpy)
    row("memcpy right before each tierckpt save (paired)", ms["tier_memcpy"])
    fb, fc = q["floor_blocking_over_memcpy"], q["floor_committed_over_memcpy"]
    row(
        "DCP floor (async_save, memcpy stager, no storage): stall",
        ms["floor_blocking"],
        f"{fb:.2f}x paired memcpy",
    )
    row("DCP floor: time-to-committed", ms["floor_committed"], f"{fc:.2f}x paired memcpy")
    b, c = q["tier_blocking_over_memcpy"], q["tier_committed_over_memcpy"]
    bb, cb = q.get("tier_blocking_over_memcpy_best"), q.get("tier_committed_over_memcpy_best")
    best_b = f" (best iteration {bb:.2f}x)" if bb is not None else ""
    best_c = f" (best iteration {cb:.2f}x)" if cb is not None else ""
    row(
        "tierckpt async_save: stall",
        ms["tier_blocking"],
        f"{b:.2f}x paired memcpy{best_b}",
        "<= 1.3",
        yes(b <= 1.3),
    )
    row(
        "tierckpt: time-to-committed",
        ms["tier_committed"],
        f"{c:.2f}x paired memcpy{best_c}",
        "<= 1.5",
        yes(c <= 1.5),
    )
    t = q["torch_blocking_over_tier_blocking"]
    row("torch async_save + FileSystemWriter: stall", ms["torch_blocking"], f"{t:.1f}x tierckpt")
    t = ms["torch_committed"] / ms["tier_committed"]
    row("torch: time-to-committed", ms["torch_committed"], f"{t:.1f}x tierckpt")
    m, f = q["tier_restore_over_memcpy"], q["tier_restore_over_fs_restore"]
    mb = q.get("tier_restore_over_memcpy_best")
    if "restore_memcpy" in ms:
        row("memcpy right before each tierckpt restore (paired)", ms["restore_memcpy"])
    row(
        "tierckpt restore (TieredStorageReader), verified",
        ms["restore_tier"],
        f"{m:.2f}x paired memcpy GB/s"
        + (f" (best {mb:.2f}x)" if mb is not None else "")
        + f"; {f:.1f}x FS",
        ">= 0.9 (0.7 at least); >= 5",
        f"{yes(m >= 0.9)}; {yes(f >= 5)}",
    )
    v = q.get("tier_restore_verified_over_unverified")
    if v is not None and "restore_tier_unverified" in ms:
        row(
            "tierckpt restore, TIERCKPT_VERIFY_READS=0",
            ms["restore_tier_unverified"],
            f"verified restore takes {v:.2f}x this",
        )
    row("FileSystemReader restore", ms["restore_fs"])
    return rows


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line ``y = a + b x``: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def fixed_cost(mem: dict[str, Any]) -> dict[str, Any] | None:
    """Split each save's steady time into a fixed part and a per-GiB part (a line through the
    sizes): the per-GiB part is the copy, which is what the memcpy ratio is about; the fixed part
    (round trips, DCP's planning) is why small states miss a ratio that large ones meet."""
    if len(mem) < 3:
        return None
    gib = [r["bytes"] / 2**30 for r in mem.values()]
    out: dict[str, Any] = {}
    for key in (
        "tier_memcpy",
        "tier_blocking",
        "tier_committed",
        "floor_blocking",
        "floor_committed",
    ):
        a, b = fit(gib, [r[key]["steady_ms"] for r in mem.values()])
        out[key] = {"fixed_ms": a, "ms_per_gib": b}
    return out


def fixed_cost_note(fc: dict[str, Any]) -> str:
    m = fc["tier_memcpy"]

    def part(key: str, label: str) -> str:
        r = fc[key]
        return (
            f"{label} {r['fixed_ms']:.1f} ms + {r['ms_per_gib']:.1f} ms/GiB "
            f"({r['ms_per_gib'] / m['ms_per_gib']:.2f}x memcpy's per-GiB)"
        )

    return (
        "fixed + per-GiB parts of the steady times (a line through the sizes): memcpy "
        f"{m['fixed_ms']:.1f} ms + {m['ms_per_gib']:.1f} ms/GiB; "
        + "; ".join(
            part(k, lbl)
            for k, lbl in (
                ("tier_blocking", "tierckpt stall"),
                ("tier_committed", "tierckpt committed"),
                ("floor_blocking", "DCP floor stall"),
                ("floor_committed", "DCP floor committed"),
            )
        )
    )


PLOT_LINES = {  # memory_tier key: label
    "tier_blocking": "tierckpt save stall",
    "tier_committed": "tierckpt time-to-committed",
    "restore_tier": "tierckpt restore",
    "memcpy": "memcpy (pre-touched)",
    "torch_blocking": "torch default async_save stall",
    "restore_fs": "FileSystemReader restore",
}


def plot(res: dict[str, Any], info: dict[str, Any], path: Path) -> None:
    """The suite's plot: GB/s of each PLOT_LINES row against the size."""
    mem = res["memory_tier"]
    lines: dict[str, list[float]] = {}
    for key, label in PLOT_LINES.items():
        if key == "memcpy":
            gbps = [
                max(mem[s]["memcpy"]["steady_gbps"], mem[s]["memcpy_late"]["steady_gbps"])
                for s in mem
            ]
        else:
            gbps = [mem[s][key]["steady_gbps"] for s in mem]
        lines[label] = gbps
    title = (
        f"tierckpt memory tier vs. baselines: {info['cores']} cores, {info['mem_gib']} GiB RAM, "
        f"no GPU\ntorch {info['torch']}, python {info['python']}, {info['checkpointer']} "
        f"checkpointer, {info['iters']} iterations"
    )
    plot_throughput(
        [int(s) for s in mem], lines, title, "state-dict size (16 float32 tensors)", path
    )
