"""Issue 24's figures, for 1 rank, 2 ranks and PROCESS mode: the verified restore of 1 GiB against
a paired memcpy (``restore.py``), a restore's fixed cost at 64 MiB with its round trips
(``restore.py``), and the stall at 64 MiB against torch's reused stager (``stall.py``).

A part of the suite only (``run_all.py``; ``--no-issue24`` leaves it out, ``--issue24-only`` runs
it alone): each figure is its scripts' own run, with their arguments below.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import BENCH, Row, run_child, yes

ISSUE24 = {  # label: restore.py / stall.py arguments
    "1 rank": ["--ranks", "1", "--fresh"],
    "2 ranks": ["--ranks", "2"],
    "PROCESS mode": ["--checkpointer", "process"],
}


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """Issue 24's figures per setting: restore.py (1 GiB: restore over paired memcpy; 64 MiB:
    the fixed cost and its round trips) and stall.py at 64 MiB (tierckpt over torch's stager)."""
    if args.no_issue24:
        notes.append("issue 24's figures skipped (--no-issue24)")
        return None
    py = [sys.executable]
    sizes, iters, stall_iters = ("16", "2", "3") if args.smoke else ("64,1024", "12", "16")
    big = sizes.split(",")[-1]
    out: dict[str, Any] = {"big_mb": big}
    for label, extra in ISSUE24.items():
        r: dict[str, Any] = {}
        path = tmp / f"i24_restore_{label.split()[0]}.json"
        cmd = [*py, str(BENCH / "restore.py"), "--sizes", sizes, "--iters", iters, *extra]
        if args.smoke:  # the mechanics only: no new processes, no pause after the save
            cmd = [c for c in cmd if c != "--fresh"] + ["--settle", "0"]
        try:
            run_child([*cmd, "--out", str(path)], f"issue 24, restore, {label}")
            r["restore"] = json.loads(path.read_text())["results"]
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            notes.append(f"issue 24 restore ({label}) skipped: {str(e).strip()[-300:]}")
        # In smoke mode 1 rank's is the stall scenario's own run, and 2 ranks make 2 rounds.
        if not (args.smoke and label == "1 rank"):
            path = tmp / f"i24_stall_{label.split()[0]}.json"
            mode = "process" if "PROCESS" in label else "thread"
            cmd = [*py, str(BENCH / "stall.py"), "--sizes", sizes.split(",")[0], "--mode", mode]
            cmd += ["--ranks", "2" if label == "2 ranks" else "1"]
            n = "2" if args.smoke and label == "2 ranks" else stall_iters
            cmd += ["--iters", n] + (["--warmup", "1"] if args.smoke else [])
            try:
                run_child([*cmd, "--out", str(path)], f"issue 24, stall, {label}")
                r["stall"] = json.loads(path.read_text())["results"]["sizes"]
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                notes.append(f"issue 24 stall ({label}) skipped: {str(e).strip()[-300:]}")
        out[label] = r
    return out


def rows(res: dict[str, Any]) -> list[Row]:
    """Issue 24: verified restore >= 0.9x memcpy (1 GiB; 0.7 at least), fixed cost <= 5 ms over
    the copy (64 MiB), stall <= torch's reused stager (64 MiB); each baseline in the same run."""
    i24 = res.get("issue24")
    if not i24:
        return []
    rows: list[Row] = []
    big = i24["big_mb"]
    for label in ISSUE24:
        r = i24.get(label, {})
        sizes = r.get("restore", {})
        small = next(iter(sizes.values()), None) if sizes else None
        large = sizes.get(big)
        if large is not None:
            v, best = large["restore_over_memcpy"], large["restore_over_memcpy_best"]
            rows.append(
                (
                    f"{big} MiB",
                    f"issue 24, {label}: verified restore (paired memcpy {large['memcpy_ms']:.0f} ms)",
                    f"{large['restore_ms']:.1f} ms",
                    f"{large['bytes'] / large['restore_ms'] / 1e6:.2f}",
                    f"{v:.2f}x memcpy GB/s (best {best:.2f})",
                    ">= 0.9 (0.7 at least)",
                    yes(v >= 0.9),
                )
            )
            if "fresh" in large:
                f = large["fresh"]
                rows.append(
                    (
                        f"{big} MiB",
                        f"issue 24, {label}: first restore in a new process (no mapping)",
                        f"{f['restore_ms']:.1f} ms",
                        "",
                        f"{f['restore_over_memcpy']:.2f}x memcpy GB/s "
                        f"(best {f['restore_over_memcpy_best']:.2f})",
                        "",
                        "",
                    )
                )
        if small is not None:
            each = ", ".join(f"{k} {v:.1f}" for k, v in small["round_trip_ms"].items())
            out = small.get("outside_copy_ms", small["fixed_ms"])
            rows.append(
                (
                    f"{next(iter(sizes))} MiB",
                    f"issue 24, {label}: restore's fixed cost (outside the verified copy)",
                    f"{out:.1f} ms (best {small.get('outside_copy_ms_best', out):.1f})",
                    "",
                    f"{small['round_trips']:.0f} round trips, {small['round_trips_ms']:.1f} ms "
                    f"({each}); the rest {small['rest_ms']:.1f} ms; restore - paired memcpy "
                    f"{small['fixed_ms']:.1f} ms",
                    "<= 5 ms",
                    yes(out <= 5),
                )
            )
            if "dcp_floor_ms" in small:
                rows.append(
                    (
                        f"{next(iter(sizes))} MiB",
                        f"issue 24, {label}: DCP's own fixed cost (FileSystemReader, the same keys "
                        "as one-element tensors, same rounds)",
                        f"{small['dcp_floor_ms']:.1f} ms",
                        "",
                        f"ours outside the copy over it: {small['outside_copy_over_floor_ms']:+.1f} "
                        "ms (median of the rounds)",
                        "",
                        "",
                    )
                )
        for size, st in r.get("stall", {}).items():
            if "skipped" in st:
                continue
            v = st["ratio_tier_over_torch"]
            rows.append(
                (
                    f"{size} MiB",
                    f"issue 24, {label}: stall (torch's reused stager)",
                    f"{st['tier_stall_ms']:.1f} ms ({st['torch_stall_ms']:.1f})",
                    "",
                    f"{v:.2f}x torch (best {st['ratio_tier_over_torch_best']:.2f}); outside the "
                    f"copy {st['tier_fixed_ms']:.1f} ms (torch {st['torch_fixed_ms']:.1f}); "
                    f"pre-leases {st['prelease_claimed']}/{st['steady_rounds']}",
                    "<= 1",
                    yes(v <= 1.0),
                )
            )
    return rows
