"""Byte counters on every socket of a process, for bench/scale.py: put this directory on a
daemon's PYTHONPATH and set ``TIERCKPT_BENCH_NETCOUNT`` to a directory; the process then writes
``<dir>/<pid>.json`` (bytes sent and received on TCP and Unix sockets, and by ``os.sendfile``)
every 20 ms while they change, and every 0.2 s with the time it was written. Without the variable this does nothing.

Why here and not /proc/<pid>/io: rchar/wchar count read()/write(), not the send()/recv() that
asyncio and httpx use on sockets. Counting in the socket methods sees what the daemon itself
sends and receives, payload bytes without TCP/IP headers.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

_DIR = os.environ.get("TIERCKPT_BENCH_NETCOUNT")
_COUNTS = {"tcp_sent": 0, "tcp_recv": 0, "unix_sent": 0, "unix_recv": 0, "sendfile": 0}
_INET = (socket.AF_INET, socket.AF_INET6)


def _kind(sock: socket.socket) -> str:
    return "tcp" if sock.family in _INET else "unix"


def _install() -> None:
    base: Any = socket.socket
    send, sendall, sendmsg = base.send, base.sendall, base.sendmsg
    recv, recv_into = base.recv, base.recv_into
    sendfile = os.sendfile

    def c_send(self: socket.socket, data: Any, *a: Any) -> int:
        n: int = send(self, data, *a)
        _COUNTS[_kind(self) + "_sent"] += n
        return n

    def c_sendall(self: socket.socket, data: Any, *a: Any) -> None:
        sendall(self, data, *a)
        _COUNTS[_kind(self) + "_sent"] += memoryview(data).nbytes

    def c_sendmsg(self: socket.socket, buffers: Any, *a: Any) -> int:
        n: int = sendmsg(self, buffers, *a)
        _COUNTS[_kind(self) + "_sent"] += n
        return n

    def c_recv(self: socket.socket, *a: Any) -> bytes:
        data: bytes = recv(self, *a)
        _COUNTS[_kind(self) + "_recv"] += len(data)
        return data

    def c_recv_into(self: socket.socket, buf: Any, *a: Any) -> int:
        n: int = recv_into(self, buf, *a)
        _COUNTS[_kind(self) + "_recv"] += n
        return n

    def c_sendfile(out_fd: int, in_fd: int, *a: Any, **k: Any) -> int:
        n: int = sendfile(out_fd, in_fd, *a, **k)
        _COUNTS["sendfile"] += n
        return n

    base.send, base.sendall, base.sendmsg = c_send, c_sendall, c_sendmsg
    base.recv, base.recv_into = c_recv, c_recv_into
    os.sendfile = c_sendfile

    path = os.path.join(str(_DIR), f"{os.getpid()}.json")

    def flush() -> None:
        # When the counts change, and every 0.2 s regardless: "t" tells a reader that the file
        # was written after a given moment, so it holds every byte sent or received before it
        # (a busy daemon's thread may be late; the reader waits for it rather than read a stale
        # file).
        last: dict[str, int] = {}
        written = 0.0
        while True:
            now = dict(_COUNTS)
            if now != last or time.time() - written > 0.2:
                tmp = f"{path}.tmp"
                written = time.time()
                with open(tmp, "w") as f:
                    json.dump({**now, "t": written}, f)
                os.replace(tmp, path)
                last = now
            time.sleep(0.02)

    threading.Thread(target=flush, name="bench-netcount", daemon=True).start()


if _DIR:
    _install()
