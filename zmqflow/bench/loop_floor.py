"""The floor of a loop-driven client: raw pyzmq round trips awaited on the running asyncio loop.

A blocking ``recv`` sleeps in libzmq until the reply is in; an asyncio client (zmqflow's, or any
other) must instead wake from the loop's poll on the socket's FD, read ``EVENTS`` and receive
without blocking. The benchmarks time raw pyzmq both ways beside zmqflow, so a small round trip's
ratio to the blocking baseline can be read against what the loop's wake-up alone costs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq

__all__ = ["awaited_round_trips"]

_NOBLOCK = int(zmq.NOBLOCK)


async def awaited_round_trips(sock: zmq.Socket, send: Callable[[], None], n: int) -> list[float]:
    """Microseconds of ``n`` round trips on ``sock``, one in flight: ``send()`` sends a request,
    and its reply (one whole message) is awaited on the running loop through a reader on the
    socket's FD. The socket is left as it was: no reader, nothing unread."""
    loop = asyncio.get_running_loop()
    fd = sock.getsockopt(zmq.FD)
    pc = time.perf_counter_ns
    waiter: asyncio.Future[None] | None = None

    def readable() -> None:
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            sock.recv_multipart(_NOBLOCK, copy=False)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    out = []
    loop.add_reader(fd, readable)
    try:
        for _ in range(n):
            t0 = pc()
            waiter = loop.create_future()
            send()
            readable()  # the FD is edge-triggered: look once after a send, as a client must
            await waiter
            out.append((pc() - t0) / 1e3)
    finally:
        loop.remove_reader(fd)
    return out
