"""The port picker of the tests, the benchmarks and the demo (tierckpt_core.launcher.free_port)."""

from __future__ import annotations

import socket

from tierckpt_core import launcher


def test_free_ports_come_from_below_the_ephemeral_range_and_can_be_bound() -> None:
    """Below the range the kernel picks outgoing connections' source ports from, so that no
    connection made meanwhile can take a port before its daemon binds it."""
    start = launcher._ephemeral_start()
    for _ in range(20):
        port = launcher.free_port()
        assert 1024 <= port < start
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", launcher.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        assert all(launcher.free_port() != taken for _ in range(200))
