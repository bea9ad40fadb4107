"""The call path's own cost: client and task server on one event loop, over inproc.

With both ends on one thread, a round trip's time is the CPU that zmqflow spends on it (client,
codec, channel, dispatch, handler, reply) with no other process or thread to wait for, so a change
to the call path shows here without the noise of cross-process scheduling. ``--channel-only``
times the same echo through the transport's channels alone (no codec, no RPC): the floor.
``--ps`` times a scalar ``assign_add`` through a session to a ps shard instead (the PS benchmark's
scalar update). ``--opcodes`` counts, instead of timing, the Python bytecodes and Python calls one
echo and one ``assign_add`` execute (``sys.settrace``): the same on every machine and every run,
so a change's effect on the Python work shows even where timings move by more than it.

    python -m zmqflow.bench.transport.one_loop [--calls N] [--channel-only | --ps | --opcodes]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import numpy as np

from ...client.session import AsyncSession
from ...loop import new_event_loop
from ...rpc import RpcClient
from ...server.task import AsyncServer
from ...transport.options import DEFAULT_OPTIONS
from ...transport.zeromq import ZmqTransport
from .zmqflow_rpc import latency, throughput

__all__ = ["main", "rpc_costs", "channel_round_trip", "ps_update", "python_steps"]


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


async def ps_update(calls: int) -> float:
    """us per scalar ``assign_add`` through a session to a ps shard on the same loop."""
    ep = f"inproc://one-loop-ps-{uuid.uuid4().hex[:8]}"
    async with AsyncServer({"ps": [ep]}, "ps:0"):
        async with AsyncSession(cluster={"ps": [ep]}, task="ps:0", timeout=30) as sess:
            var = await sess.variable("scalar", 0.0)
            for _ in range(min(calls, 500)):  # warm up
                await var.assign_add(1.0)
            t0 = time.perf_counter()
            for _ in range(calls):
                await var.assign_add(1.0)
            return (time.perf_counter() - t0) / calls * 1e6


class _Steps:
    """A ``sys.settrace`` hook counting Python calls and the bytecodes they execute."""

    def __init__(self) -> None:
        self.calls = 0
        self.opcodes = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> "_Steps":
        if event == "opcode":
            self.opcodes += 1
        elif event == "call":  # a call, or a coroutine resumed
            self.calls += 1
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        return self


async def _count(step: Callable[[], Awaitable[Any]], calls: int) -> tuple[float, float]:
    """(bytecodes, Python calls) per ``await step()``, after a warm-up."""
    for _ in range(100):
        await step()
    steps, before = _Steps(), sys.gettrace()
    sys.settrace(steps)
    try:
        for _ in range(calls):
            await step()
    finally:
        sys.settrace(before)  # a debugger's or coverage's tracer, if any, back as it was
    return steps.opcodes / calls, steps.calls / calls


async def python_steps(calls: int) -> dict[str, tuple[float, float]]:
    """(bytecodes, Python calls) per 64 B echo and per scalar ``assign_add``, on one loop."""
    out = {}
    ep = f"inproc://one-loop-ops-{uuid.uuid4().hex[:8]}"
    async with AsyncServer({"worker": [ep], "ps": [ep + "-ps"]}, "worker:0"), AsyncServer(
            {"worker": [ep], "ps": [ep + "-ps"]}, "ps:0"):
        client = RpcClient(identity=f"one-loop-{uuid.uuid4().hex[:6]}")
        try:
            body = {"x": np.zeros(64, np.uint8)}
            out["echo"] = await _count(lambda: client.call(ep, "worker", "echo", body, timeout=10.0), calls)
        finally:
            client.close()
        async with AsyncSession(cluster={"worker": [ep], "ps": [ep + "-ps"]}, task="ps:0", timeout=30) as sess:
            var = await sess.variable("scalar", 0.0)
            out["assign_add"] = await _count(lambda: var.assign_add(1.0), calls)
    return out


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
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--channel-only", action="store_true", help="the transport's channels alone: the floor")
    what.add_argument("--ps", action="store_true", help="a scalar assign_add through a session to a ps shard")
    what.add_argument("--opcodes", action="store_true",
                      help="count the Python bytecodes and calls of one echo and one assign_add instead of timing")
    args = parser.parse_args(argv)
    loop = new_event_loop()
    try:
        if args.opcodes:
            for name, (ops, calls) in loop.run_until_complete(python_steps(min(args.calls, 2000))).items():
                print(f"{name}, one loop: {ops:.0f} Python bytecodes, {calls:.0f} Python calls per round trip")
        elif args.ps:
            print(f"assign_add, 4 B, one loop: {loop.run_until_complete(ps_update(args.calls)):.1f} us per update")
        elif args.channel_only:
            print(f"channel echo, 64 B, one loop: {loop.run_until_complete(channel_round_trip(args.calls)):.1f} us per round trip")
        else:
            rt, call = loop.run_until_complete(rpc_costs(args.calls))
            print(f"RPC echo, 64 B, one loop: {rt:.1f} us per round trip; {call:.1f} us per call with 64 in flight")
    finally:
        loop.close()


if __name__ == "__main__":
    main()
