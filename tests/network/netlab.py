"""Nodes on a real network, for the network-fault tests (issue 32).

A :class:`Lab` is ``n`` Linux network namespaces, one per node, each with one veth pair whose other
end sits on a bridge in a namespace of its own, and an address in a small subnet
(``10.231.<x>.0/24``) that exists only inside them: the root namespace has no route to it, and two
labs (two test sessions) never see each other. Each node's daemon runs in its namespace through
``ip netns exec`` (:meth:`Lab.daemons`); trainers reach a daemon over its Unix socket in the tmpfs
directory, which no network fault touches.

Faults are nftables rules inside a node's namespace (table ``inet tckfault``, on its ``eth0``):
a blackhole (everything in and out dropped: connects and reads hang until a timeout, unlike a
killed process, which refuses at once), one-way drops to or from chosen nodes, random loss
(``numgen random mod 100 < N``), and the link itself set down or up. This kernel has no ``netem``,
so latency comes from :mod:`delayproxy`, a TCP proxy that holds each chunk for a while, run in the
node's namespace in front of its daemon (which then binds loopback there).

Every namespace is named ``tckn<pid>-<lab>-...`` after the test process that made it:
:func:`reap_stale` removes those of processes that are gone (a crashed earlier run) and never
another live session's. Needs root, ``ip`` (iproute2) and ``nft`` (nftables); :func:`unavailable`
says why not where they are missing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tierckpt_core.launcher import DaemonProcess, new_shm_dir

PREFIX = "tckn"
PORT = 8474  # every node has its own port space: the same port on each
IFACE = "eth0"
TABLE = "tckfault"
_PROXY = Path(__file__).with_name("delayproxy.py")
_labs = itertools.count()


def _run(args: list[str], *, stdin: str | None = None, check: bool = True) -> str:
    """Run a network command (bounded); its stdout. Fails naming the command and its stderr."""
    try:
        done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(args)}` did not finish within 30 s") from None
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why network namespaces with nftables rules cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "the network-fault tests make network namespaces, which needs root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install {package})"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "netns", "exec", probe, "nft", "-f", "-"], stdin="table inet probe {\n}\n")
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    except RuntimeError as e:
        return f"cannot make a network namespace with nftables rules here: {e}"
    return None


def namespaces() -> list[str]:
    """The names of this machine's named network namespaces."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _owner(ns: str) -> int | None:
    """The pid of the test process that made namespace ``ns``, if it is one of ours."""
    if not ns.startswith(PREFIX):
        return None
    head = ns[len(PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(ns: str) -> None:
    """Kill what still runs in our namespace ``ns`` (daemons and proxies this suite started)
    and delete it."""
    for pid in _run(["ip", "netns", "pids", ns], check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run(["ip", "netns", "del", ns], check=False)


def reap_stale() -> list[str]:
    """Remove the namespaces left by earlier test runs whose process is gone; their names."""
    gone = []
    for ns in namespaces():
        pid = _owner(ns)
        if pid is not None and not _alive(pid):
            _remove(ns)
            gone.append(ns)
    return gone


class Lab:
    """``n`` nodes, each in its own network namespace, on one bridge."""

    def __init__(self, n: int) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{next(_labs)}"
        self.net = f"10.231.{random.randrange(1, 255)}"
        self.bridge = f"{self.tag}-br"
        self.names = [f"{self.tag}-n{i}" for i in range(n)]
        self.proxies: dict[int, subprocess.Popen[str]] = {}

    def addr(self, i: int) -> str:
        return f"{self.net}.{11 + i}"

    def endpoint(self, i: int) -> str:
        """Node ``i``'s daemon as its peers dial it (its node name)."""
        return f"{self.addr(i)}:{PORT}"

    def exec(self, i: int) -> list[str]:
        """The command prefix that runs a program on node ``i``."""
        return ["ip", "netns", "exec", self.names[i]]

    def up(self) -> Lab:
        try:
            br = self.bridge
            _run(["ip", "netns", "add", br])
            _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", br, "link", "set", "br0", "up"])
            for i, ns in enumerate(self.names):
                _run(["ip", "netns", "add", ns])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                port = f"p{i}"
                _run(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", IFACE,
                      "netns", ns])  # fmt: skip
                _run(["ip", "-n", br, "link", "set", port, "master", "br0", "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFACE])
                _run(["ip", "-n", ns, "link", "set", IFACE, "up"])
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop the proxies and remove every namespace of the lab (what runs there is killed)."""
        for p in self.proxies.values():
            p.kill()
            p.wait(10)
            if p.stdout is not None:
                p.stdout.close()
        self.proxies.clear()
        present = set(namespaces())
        for ns in [*self.names, self.bridge]:
            if ns in present:
                _remove(ns)

    # -- daemons ------------------------------------------------------------------------------

    def daemons(
        self, *, token: str, proxied: frozenset[int] = frozenset(), **settings: Any
    ) -> list[DaemonProcess]:
        """One daemon per node (not started), each other's peers. The nodes in ``proxied`` bind
        loopback in their namespace, for a :meth:`delay` proxy to stand on their address."""
        peers = ",".join(self.endpoint(i) for i in range(len(self.names)))
        return [
            DaemonProcess(
                new_shm_dir("tierckpt-net"),
                wrap=self.exec(i),
                host="127.0.0.1" if i in proxied else self.addr(i),
                port=PORT,
                node_name=self.endpoint(i),
                peers=peers,
                peer_token=token,
                **settings,
            )
            for i in range(len(self.names))
        ]

    @staticmethod
    def replacement(d: DaemonProcess) -> DaemonProcess:
        """A new, empty daemon for ``d``'s node: same name, settings and namespace, fresh tier."""
        return DaemonProcess(new_shm_dir("tierckpt-net"), wrap=d.wrap, **d.settings)

    def delay(self, i: int, ms: float) -> None:
        """Latency on node ``i``: a proxy on its address holds every chunk, both ways, ``ms``
        before passing it to (or from) its daemon on loopback (see :meth:`daemons`)."""
        cmd = [*self.exec(i), sys.executable, str(_PROXY), self.endpoint(i), f"127.0.0.1:{PORT}",
               str(ms)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.proxies[i] = proc
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            raise RuntimeError(f"the delay proxy on node {i} did not start: {line!r}")

    # -- faults -------------------------------------------------------------------------------

    def _rules(self, i: int, inbound: list[str], outbound: list[str]) -> None:
        """Node ``i``'s fault rules, in place of any it had."""
        self.heal(i)
        rules_in = "".join(f'    iifname "{IFACE}" {r}\n' for r in inbound)
        rules_out = "".join(f'    oifname "{IFACE}" {r}\n' for r in outbound)
        script = (
            f"table inet {TABLE} {{\n"
            f"  chain in {{\n    type filter hook input priority 0\n{rules_in}  }}\n"
            f"  chain out {{\n    type filter hook output priority 0\n{rules_out}  }}\n"
            "}\n"
        )
        _run([*self.exec(i), "nft", "-f", "-"], stdin=script)

    def blackhole(self, i: int, port: int | None = None) -> None:
        """Node ``i`` alive but unreachable: every packet in and out dropped (``port``: only
        those to or from that TCP port, e.g. the daemons' while the trainers' traffic flows)."""
        rules = ["drop"] if port is None else [f"tcp dport {port} drop", f"tcp sport {port} drop"]
        self._rules(i, rules, rules)

    def deaf_to(self, i: int, others: list[int]) -> None:
        """One way: node ``i`` receives nothing from ``others`` (it still sends to them)."""
        self._rules(i, [f"ip saddr {self.addr(j)} drop" for j in others], [])

    def mute_to(self, i: int, others: list[int]) -> None:
        """One way: nothing node ``i`` sends reaches ``others`` (it still receives)."""
        self._rules(i, [], [f"ip daddr {self.addr(j)} drop" for j in others])

    def loss(self, i: int, percent: int) -> None:
        """Random loss of ``percent`` % of node ``i``'s packets, each way."""
        rule = f"numgen random mod 100 < {percent} drop"
        self._rules(i, [rule], [rule])

    def heal(self, i: int) -> None:
        """Node ``i``'s fault rules removed (none is fine)."""
        _run([*self.exec(i), "nft", "delete", "table", "inet", TABLE], check=False)

    def link(self, i: int, up: bool) -> None:
        """Node ``i``'s link set down or up (``ip link set``)."""
        _run(["ip", "-n", self.names[i], "link", "set", IFACE, "up" if up else "down"])

    def heal_all(self) -> None:
        for i in range(len(self.names)):
            self.heal(i)
            self.link(i, True)


def wait_for(what: str, check: Any, timeout: float, every: float = 0.05) -> Any:
    """Poll ``check()`` until it returns something true (returned); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}: last {got!r}")
        time.sleep(every)
