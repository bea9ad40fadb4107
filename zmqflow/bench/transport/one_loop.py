"""The call path's own cost: client and task server on one event loop, over inproc.

With both ends on one thread, a round trip's time is the CPU that zmqflow spends on it (client,
codec, channel, dispatch, handler, reply) with no other process or thread to wait for, so a change
to the call path shows here without the noise of cross-process scheduling. ``--channel-only``
times the same echo through the transport's channels alone (no codec, no RPC): the floor.

    python -m zmqflow.bench.transport.one_loop [--calls N] [--channel-only]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import numpy as np

from ...loop import new_event_loop
from ...rpc import RpcClient
from ...server.task import AsyncServer
from ...transport.options import DEFAULT_OPTIONS
from ...transport.zeromq import ZmqTransport
from .zmqflow_rpc import latency, throughput

__all__ = ["main", "rpc_costs", "channel_round_trip"]


async def rpc_costs(calls: int, size: int = 64) -> tuple[float, float]:
    """(us per round trip with one call in flight, us per call with 64 in flight)."""
    ep = f"inproc://one-loop-{uuid.uuid4().hex[:8]}"
    async with AsyncServer({"worker": [ep]}, "worker:0"):
        client = RpcClient(identity=f"one-loop-{uuid.uuid4().hex[:6]}")
        try:
            arr = np.zeros(size, np.uint8)
            await client.call(ep, "worker", "echo", {"x": arr})
            t0 = time.perf_counter()
            await latency(client, ep, arr, calls)
            rt = (time.perf_counter() - t0) / calls
            tput = await throughput(client, ep, arr, calls * 2, 64) / (calls * 2)
        finally:
            client.close()
    return rt * 1e6, tput * 1e6


async def channel_round_trip(calls: int, size: int = 64) -> float:
    """us per echo through a listener and a connection, the frames passed back untouched."""
    loop = asyncio.get_running_loop()
    transport = ZmqTransport()
    ep = f"inproc://one-loop-ch-{uuid.uuid4().hex[:8]}"
    box: list = [None, None]

    def on_request(frames: list, user: str | None = None) -> None:
        box[1].try_send(frames)

    box[1] = await transport.listen(ep, on_request, loop=loop, options=DEFAULT_OPTIONS, name="server")
    conn = transport.connect(ep, b"client", lambda frames: box[0].set_result(None), lambda state: None,
                             loop=loop, options=DEFAULT_OPTIONS, name="client")
    try:
        arr = np.zeros(size, np.uint8)
        header = b"\0" * 40
        t0 = time.perf_counter()
        for _ in range(calls):
            box[0] = loop.create_future()
            if not await conn.send([header, arr], loop.time() + 10):  # waits for the connection, within 10 s
                raise RuntimeError(f"the channel to {ep} took no message within 10 s")
            await asyncio.wait_for(box[0], 10)
        return (time.perf_counter() - t0) / calls * 1e6
    finally:
        conn.close()
        box[1].close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zmqflow.bench.transport.one_loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--channel-only", action="store_true", help="the transport's channels alone: the floor")
    args = parser.parse_args(argv)
    loop = new_event_loop()
    try:
        if args.channel_only:
            print(f"channel echo, 64 B, one loop: {loop.run_until_complete(channel_round_trip(args.calls)):.1f} us per round trip")
        else:
            rt, call = loop.run_until_complete(rpc_costs(args.calls))
            print(f"RPC echo, 64 B, one loop: {rt:.1f} us per round trip; {call:.1f} us per call with 64 in flight")
    finally:
        loop.close()


if __name__ == "__main__":
    main()
