"""``bench/peers.py``'s command line: ``--ranks`` and ``--sizes`` (issue 35's 2-rank mode)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def peers(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the benches import each other by name
    return importlib.import_module("peers")


def test_smoke_in_two_ranks_is_the_smoke_with_the_ranks(peers: ModuleType) -> None:
    args = peers.parse_args(["--smoke", "--ranks", "2"])
    assert (args.ranks, args.size_list, args.iters, args.warmup) == (2, [8], 3, 1)
    assert peers.parse_args([]).ranks == 1  # one process unless asked
    assert peers.parse_args(["--tensors", "2048"]).tensors == 2048
    assert peers.parse_args([]).tensors == 16


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--ranks", "0"], "--ranks 0: 1 (one process) to 8"),
        (["--tensors", "0"], "--tensors 0: at least 1"),
        (["--ranks", "9"], "--ranks 9: 1 (one process) to 8"),
        (["--sizes", "0"], "each >= 1 MiB"),
        (["--sizes", "1g"], "MiB as whole numbers"),
        (["--peers", "tierckpt,nvrx"], "unknown peers ['nvrx']"),
    ],
)
def test_bad_arguments_are_named(
    peers: ModuleType, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        peers.parse_args(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
