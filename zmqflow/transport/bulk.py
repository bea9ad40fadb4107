"""Bulk streams: a plain TCP connection beside a task's ROUTER that carries large tensor bytes
straight to where they belong.

libzmq reads every message into a buffer of its own, so a pull into the caller's arrays costs a
second pass over memory (the copy out of that buffer) that raw pyzmq, keeping the buffer, does
not pay. A stream read with ``recv_into`` lands the bytes in the caller's array itself: the
kernel's copy is the only one.

The stream carries bytes only. What they are travels as an ordinary request over ZeroMQ (checked,
deadlined, authenticated as any other); the stream itself is opened with a one-time token that
the task issued over that connection, so it is worth no more than the connection that asked.

Wire: the client opens with :data:`HELLO` (magic + token), the task answers :data:`OPENED`;
after that each transfer is a 16-byte header (tag, byte count; little-endian u64) and then that
many bytes, server to client. This module holds the format and the hello's socket calls; who may
open a stream is :mod:`zmqflow.server.bulk_listener`'s, what a client expects
:mod:`zmqflow.client.bulk`'s.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from typing import Literal

import numpy as np

__all__ = ["MAGIC", "TOKEN_BYTES", "HELLO", "HEADER", "OPENED", "as_bytes", "recv_exact", "recv_into", "tune",
           "BULK_ENV", "bulk_enabled", "Kind", "family"]

MAGIC = b"ZFB1"
TOKEN_BYTES = 16
HELLO = struct.Struct(f"<4s{TOKEN_BYTES}s")
HEADER = struct.Struct("<QQ")  # tag, byte count
OPENED = b"\x01"  # the task's answer to a good hello: the stream is open
BULK_ENV = "ZMQFLOW_BULK"  # "0" turns bulk streams off on a task (it offers none) and in a session
Kind = Literal["pull", "push"]  # which way a stream's transfers go: task to client, or client to task


def bulk_enabled() -> bool:
    """Whether this process offers and asks for bulk streams (``ZMQFLOW_BULK=0``: neither)."""
    return os.environ.get(BULK_ENV, "").strip() != "0"


def family(host: str) -> socket.AddressFamily:
    """The address family of a host as a cluster spec or a bind names it (IPv6 has colons)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def as_bytes(a: np.ndarray) -> memoryview:
    """A flat byte view of a C-contiguous array, whatever its dtype (bfloat16 too, which a plain
    memoryview refuses)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def tune(sock: socket.socket) -> None:
    """Non-blocking, as the loop's socket calls of the hello want, and no delay on the small
    header. Once open, each end hands the socket to threads that block in the kernel for a whole
    transfer: a loop moving it a socket buffer at a time spent more CPU than ZeroMQ's I/O thread."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # a peer whose host vanished (no FIN) is found within about a minute and a half, so its
        # stream is closed and its slot freed, as ZeroMQ's heartbeats find it on the router
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


async def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the stream; ConnectionError when the peer closes first."""
    loop = asyncio.get_running_loop()
    while view.nbytes:
        n = await loop.sock_recv_into(sock, view)
        if not n:
            raise ConnectionError("bulk stream closed by its peer")
        view = view[n:]


async def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes (a header, a hello)."""
    buf = bytearray(n)
    await recv_into(sock, memoryview(buf))
    return bytes(buf)
