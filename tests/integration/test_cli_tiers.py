"""The ``tierckpt`` CLI across tiers (issue 12 items 10-11, issue 14 item 7): ``ls``/``inspect``
see the persistent tier, ``verify`` reads every copy, ``rm --persistent``, help and exit codes,
``export`` without torch, a closed stdout. Real daemons, a real ``file://`` tier, one S3 test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from helpers import DaemonProcess
from kit import CLI, cli, cli_json, flip_byte, save, seeded_state, wait_durable

N = 64 * 1024  # 256 KiB of float32 per step


@pytest.fixture
def tiered(tmp_path: Path, make_node: Callable[..., DaemonProcess]) -> DaemonProcess:
    """A daemon whose file:// persistent tier takes a namespace's first step and no other
    (``persist_every=1000``) until ``tierckpt persist``."""
    return make_node(client=True, persist_url=f"file://{tmp_path / 'store'}", persist_every=1000)


# -- help, exit codes, export without torch, closed stdout (no tier needed) ---------------------


def _help_entries(text: str) -> list[tuple[str, bool]]:
    """(argument, has help) for each entry of argparse's argument sections."""
    lines = text.splitlines()
    out = []
    section = False
    for i, line in enumerate(lines):
        if not line.startswith(" "):  # a section title, or the blank line that ends one
            section = line in ("positional arguments:", "options:")
        elif section and re.match(r"  \S", line):
            head, _, rest = line.strip().partition("  ")
            follows = i + 1 < len(lines) and lines[i + 1].startswith(" " * 8)
            out.append((head, bool(rest.strip()) or follows))
    return out


def test_help_documents_every_subcommand_argument_and_the_exit_codes() -> None:
    top = cli("--help")
    assert top.returncode == 0
    assert "exit codes:" in top.stdout
    for code in ("0", "1", "2", "3", "4", "5", "6", "141"):
        assert re.search(rf"^\s+{code}\s+\S", top.stdout, re.M), f"exit code {code} not listed"
    names = ["status", "ls", "inspect", "verify", "rm", "export", "persist", "prefetch"]
    for name in names:
        assert re.search(rf"^\s+{name}\s+\S", top.stdout, re.M), f"{name} has no summary"
        sub = cli(name, "--help")
        assert sub.returncode == 0, sub.stderr
        entries = _help_entries(sub.stdout)
        assert entries, sub.stdout
        missing = [arg for arg, has_help in entries if not has_help]
        assert not missing, f"tierckpt {name}: no help for {missing}\n{sub.stdout}"
        assert "exit codes:" in sub.stdout


def test_export_without_torch_names_the_extra(client_env: DaemonProcess, tmp_path: Path) -> None:
    # torch made unimportable the way a missing package is (ModuleNotFoundError on import).
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from tierckpt_client.cli import main\n"
        f"sys.exit(main(['export', 'job', 'latest', {str(tmp_path / 'out')!r}]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr == (
        "tierckpt: tierckpt export needs torch, which is not installed: "
        "pip install 'tierckpt[client]'\n"
    )


def test_json_into_a_closed_pipe_exits_quietly(client_env: DaemonProcess) -> None:
    save("job", 1, seeded_state(1, N), staged=False)
    # The reader is gone before the CLI writes (what `| head` does after its first lines).
    for args in (["--json", "ls"], ["--json", "ls", "job"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            proc = subprocess.run(
                [*CLI, *args], stdout=write_end, stderr=subprocess.PIPE, timeout=60
            )
        finally:
            os.close(write_end)
        assert (proc.returncode, proc.stderr) == (141, b""), args


# -- ls / inspect see the persistent tier --------------------------------------------------------


def test_ls_and_inspect_show_checkpoints_only_the_persistent_tier_holds(
    tiered: DaemonProcess, tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    save("job-a", 10, seeded_state(10, N), staged=False)  # first steps: persisted by the policy
    save("job-b", 3, seeded_state(3, N), staged=False)
    wait_durable("job-a", 10)
    wait_durable("job-b", 3)
    save("job-a", 20, seeded_state(20, N), staged=False)  # memory only
    # The node is replaced: its memory is gone, the persistent tier holds both namespaces.
    tiered.kill()
    shutil.rmtree(tiered.shm_dir)
    tiered.start()

    text = cli("ls").stdout
    assert "no namespaces" not in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert set(rows) == {"job-a", "job-b"}
    assert rows["job-a"][-1] == "persistent"
    namespaces = {d["namespace"]: d for d in cli_json("ls")}
    assert namespaces["job-a"]["durable_steps"] == 1 and namespaces["job-a"]["steps"] == 0
    assert namespaces["job-b"]["latest_committed"] == 3
    assert namespaces["job-b"]["tiers"] == ["persistent"]

    info = cli_json("inspect", "job-a", "10")
    assert info["tiers"] == ["persistent"] and info["in_memory"] is False
    assert info["state"] == "durable" and info["world_size"] == 1
    assert sum(f["length"] for f in info["files"]) >= N * 4
    assert all(f["checksum"].startswith("xxh3_128:") for f in info["files"])
    human = cli("inspect", "job-a", "10").stdout
    assert "tiers       persistent" in human
    proc = cli("inspect", "job-a", "20")  # lost with the node's memory
    assert proc.returncode == 3
    assert f"not in memory or in file://{tmp_path / 'store'}" in proc.stderr

    # A daemon without a persistent tier, and TIERCKPT_PERSIST_URL naming the store: same view.
    plain = make_node()
    env = {"TIERCKPT_SOCKET": str(plain.socket)}
    bare = cli("--json", "ls", env=env)
    assert json.loads(bare.stdout) == []
    env["TIERCKPT_PERSIST_URL"] = f"file://{tmp_path / 'store'}"
    docs = json.loads(cli("--json", "ls", env=env).stdout)
    assert [d["namespace"] for d in docs] == ["job-a", "job-b"]
    steps = json.loads(cli("--json", "ls", "job-a", env=env).stdout)
    assert [(s["step"], s["tiers"]) for s in steps] == [(10, ["persistent"])]


# -- verify ------------------------------------------------------------------------------------


def test_verify_checks_every_tier_and_finds_corruption(
    tiered: DaemonProcess, tmp_path: Path
) -> None:
    save("job", 1, seeded_state(1, N), staged=False)
    wait_durable("job", 1)
    doc = cli_json("verify", "job", "1")
    assert doc["ok"] is True and doc["tiers"] == ["memory", "persistent"]
    assert {(f["tier"], f["result"]) for f in doc["files"]} == {
        ("memory", "ok"),
        ("persistent", "ok"),
    }
    text = cli("verify", "job", "1").stdout
    assert re.search(r"job step 1: (\d+) of \1 file\(s\) verified in memory, persistent", text)

    # Just committed (its upload may not have started): verifiable in memory at once, against
    # the checksums the ranks took when they wrote the files.
    save("job", 2, seeded_state(2, N), staged=False)
    doc = cli_json("verify", "job", "2")
    assert doc["ok"] is True and "memory" in doc["tiers"], doc
    assert {f["result"] for f in doc["files"] if f["tier"] == "memory"} == {"ok"}, doc

    # One flipped byte in the persistent copy, then one in the memory copy.
    data = max(
        (p for p in (tmp_path / "store" / "job" / f"step_{1:012d}").iterdir()),
        key=lambda p: p.stat().st_size,
    )
    flip_byte(data, 1000, 0xFF)
    proc = cli("verify", "job", "1", "--json")
    assert proc.returncode == 5
    bad = [f for f in json.loads(proc.stdout)["files"] if f["result"] != "ok"]
    assert [(f["tier"], f["file"], f["result"]) for f in bad] == [
        ("persistent", data.name, "CORRUPT")
    ]
    assert "1 file(s) corrupt or missing" in proc.stderr
    flip_byte(data, 1000, 0xFF)  # repaired

    in_memory = list(tiered.shm_dir.glob(f"ns/job/{1:012d}-*/{data.name}"))
    assert len(in_memory) == 1
    flip_byte(in_memory[0], 1000, 0xFF)
    bad = [f for f in json.loads(cli("verify", "job", "1", "--json").stdout)["files"]]
    assert [(f["tier"], f["result"]) for f in bad if f["result"] != "ok"] == [("memory", "CORRUPT")]
    assert cli("verify", "job", "99").returncode == 3


# -- rm --persistent -----------------------------------------------------------------------------


def test_rm_persistent_needs_yes_then_removes_every_copy(
    tiered: DaemonProcess, tmp_path: Path
) -> None:
    save("job", 1, seeded_state(1, N), staged=False)
    wait_durable("job", 1)
    step_dir = tmp_path / "store" / "job" / f"step_{1:012d}"
    assert step_dir.is_dir()

    proc = cli("rm", "job", "1", "--persistent")
    assert proc.returncode == 2
    assert "cannot be undone; add --yes" in proc.stderr
    assert step_dir.is_dir() and cli_json("inspect", "job", "1")["in_memory"]

    proc = cli("rm", "job", "1", "--persistent", "--yes")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "removed job step 1 from memory and persistent"
    assert not any(step_dir.iterdir()) if step_dir.exists() else True
    assert cli("inspect", "job", "1").returncode == 3
    assert cli("ls", "job").returncode == 3
    assert cli("rm", "job", "1", "--persistent", "--yes").returncode == 3


# -- the same against S3 -------------------------------------------------------------------------


@pytest.mark.usefixtures("s3_env")
def test_ls_verify_rm_against_s3(seaweed: Any, make_node: Callable[..., DaemonProcess]) -> None:
    url = f"s3://{seaweed.bucket}/cli-{uuid.uuid4().hex[:8]}"
    d = make_node(client=True, persist_url=url)
    save("job", 5, seeded_state(5, N), staged=False)
    wait_durable("job", 5)
    d.kill()
    shutil.rmtree(d.shm_dir)
    d.start()
    assert [(x["namespace"], x["tiers"]) for x in cli_json("ls")] == [("job", ["persistent"])]
    doc = cli_json("verify", "job", "5")
    assert doc["tiers"] == ["persistent"] and doc["ok"] is True
    assert cli("rm", "job", "5", "--persistent", "--yes").stdout.strip() == (
        "removed job step 5 from persistent"
    )
    assert cli_json("ls") == []
    # A store that cannot be listed: memory is still shown, the error is named, exit 1.
    save("mem-only", 1, seeded_state(1, N), staged=False)
    proc = cli("ls", env={"TIERCKPT_PERSIST_URL": "s3://no-such-bucket-cli/x"})
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[1].split()[0] == "mem-only"
    assert proc.stderr.startswith("tierckpt: cannot list the persistent tier s3://no-such-")
