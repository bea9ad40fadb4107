"""The measured side: zmqflow's RPC path, an ``RpcClient`` against a task server's ``worker``
service (``sink`` answers each call with the byte count, ``echo`` sends the array back)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from ...rpc import RpcClient

__all__ = ["check", "latency", "throughput"]

_CALL_TIMEOUT = 120.0


async def throughput(client: RpcClient, ep: str, arr: np.ndarray, n: int, window: int) -> float:
    """Seconds to complete ``n`` ``worker.sink`` calls with ``window`` in flight."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    body = {"x": arr}
    start_call = client.start_call
    state = [0, 0]  # sent, done

    def issue() -> None:
        state[0] += 1
        start_call(ep, "worker", "sink", body, timeout=_CALL_TIMEOUT).add_done_callback(on_done)

    def on_done(fut: asyncio.Future) -> None:
        if finished.done():
            return
        exc = fut.exception()
        if exc is not None:
            finished.set_exception(exc)
            return
        state[1] += 1
        if state[0] < n:
            issue()
        elif state[1] == n:
            finished.set_result(None)

    t0 = time.perf_counter()
    for _ in range(min(window, n)):
        issue()
    await finished
    return time.perf_counter() - t0


async def latency(client: RpcClient, ep: str, arr: np.ndarray, n: int) -> list[float]:
    """Round-trip microseconds of ``n`` ``worker.echo`` calls, one in flight."""
    body = {"x": arr}
    call = client.call
    pc = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = pc()
        await call(ep, "worker", "echo", body, timeout=_CALL_TIMEOUT)
        out.append((pc() - t0) / 1e3)
    return out


async def check(client: RpcClient, ep: str, arr: np.ndarray) -> None:
    """Raise unless ``echo`` returns ``arr`` unchanged and ``sink`` counts all its bytes."""
    reply = await client.call(ep, "worker", "echo", {"x": arr}, timeout=_CALL_TIMEOUT)
    got = reply.get("x") if isinstance(reply, dict) else None
    if not isinstance(got, np.ndarray) or got.dtype != arr.dtype or not np.array_equal(got, arr):
        raise RuntimeError("zmqflow echo returned different data")
    nbytes = await client.call(ep, "worker", "sink", {"x": arr}, timeout=_CALL_TIMEOUT)
    if nbytes != arr.nbytes:
        raise RuntimeError(f"zmqflow sink counted {nbytes} bytes, sent {arr.nbytes}")
