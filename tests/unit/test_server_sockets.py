"""The daemon's TCP listener: every connection it accepts has Nagle off (``TCP_NODELAY``), so an
answer written as head and body does not wait for the caller's delayed ACK (40 ms per round trip
between peers on a kept-alive connection, before)."""

from __future__ import annotations

import asyncio
import socket

from tierckpt_daemon.server import _bind_tcp


def test_connections_to_the_tcp_port_have_nagle_off() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        seen: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = _bind_tcp("127.0.0.1", 0)
        server = await loop.create_server(Probe, sock=listener)  # as uvicorn serves it
        port = listener.getsockname()[1]
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        finally:
            server.close()
        return value

    assert asyncio.run(main()) != 0
