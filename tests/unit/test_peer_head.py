"""Reading a peer's response head off a socket that is then handed to a trainer: the status and
headers, and not one byte of the body, however the head arrives in pieces."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tierckpt_core.errors import PeerUnavailableError, ProtocolError
from tierckpt_daemon.peers.bodies import read_head

HEAD = (
    b"HTTP/1.1 206 Partial Content\r\ncontent-length: 10\r\nContent-Range: bytes 5-14/100\r\n\r\n"
)
BODY = b"0123456789"


def _send_in_pieces(sock: socket.socket, data: bytes, cuts: list[int]) -> None:
    at = 0
    for cut in [*cuts, len(data)]:
        sock.sendall(data[at:cut])
        at = cut
        time.sleep(0.02)  # each piece arrives on its own


@pytest.mark.parametrize(
    "cuts",
    [
        [],  # head and body in one piece
        [len(HEAD) - 2],  # the blank line split in two
        [len(HEAD) - 3, len(HEAD) - 1],  # ... and in three
        [1, 20, len(HEAD)],  # the head in pieces, the body on its own
        list(range(1, len(HEAD) + 3)),  # byte by byte
    ],
)
def test_the_head_is_read_and_the_body_left_on_the_socket(cuts: list[int]) -> None:
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(10)
        sender = threading.Thread(target=_send_in_pieces, args=(a, HEAD + BODY, cuts))
        sender.start()
        status, headers = read_head(b, "test")
        sender.join()
        assert status == 206
        assert headers["content-range"] == "bytes 5-14/100"  # names lowercased
        assert headers["content-length"] == "10"
        body = b""
        while len(body) < len(BODY):
            body += b.recv(100)
        assert body == BODY


def test_a_closed_connection_and_a_non_http_answer_are_named() -> None:
    a, b = socket.socketpair()
    with b:
        a.sendall(b"HTTP/1.1 200 OK\r\n")
        a.close()
        with pytest.raises(PeerUnavailableError, match="closed"):
            read_head(b, "peer x")
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")
        with pytest.raises(ProtocolError, match="not an HTTP/1 response"):
            read_head(b, "peer x")
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello")
        with pytest.raises(ProtocolError, match="chunked"):
            read_head(b, "peer x")
