"""A TCP proxy that adds latency: every chunk read in either direction is written on after
``delay_ms`` (in order; a close follows the last chunk after the same delay). This kernel has no
``netem``, so a node's network tests get their latency from this, run inside the node's network
namespace in front of its daemon: ``python delayproxy.py LISTEN_HOST:PORT TARGET_HOST:PORT MS``.
Prints ``ready`` once it listens. Standard library only."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

CONNECT_TIMEOUT_S = 5.0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it arrived."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, chunk = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:  # the other side closed: pass it on
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(chunk)
            await writer.drain()

    sender = asyncio.create_task(send())
    try:
        while True:
            chunk = await reader.read(65536)
            queue.put_nowait((time.monotonic() + delay_s, chunk))
            if not chunk:
                break
        await sender
    except (OSError, asyncio.IncompleteReadError):
        sender.cancel()


async def _serve(
    target: tuple[str, int], delay_s: float, cr: asyncio.StreamReader, cw: asyncio.StreamWriter
) -> None:
    try:
        sr, sw = await asyncio.wait_for(asyncio.open_connection(*target), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        cw.close()
        return
    try:
        await asyncio.gather(_pipe(cr, sw, delay_s), _pipe(sr, cw, delay_s))
    finally:
        for w in (cw, sw):
            w.close()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def main(listen: str, target: str, delay_ms: float) -> None:
    host, port = _addr(listen)
    to = _addr(target)
    server = await asyncio.start_server(
        lambda r, w: _serve(to, delay_ms / 1000.0, r, w), host, port
    )
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
