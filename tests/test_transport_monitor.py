"""A connection's socket monitor never stalls the process's other connections.

libzmq's I/O thread hands each monitor event over with a blocking send. With the queue bounded, a
connection whose events nobody reads (its loop blocked, or gone while the socket lives on) stalls
that thread once its queue fills, and every tcp and ipc connection of the process with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import pytest
import zmq

from zmqflow.transport.context import context
from zmqflow.transport.options import DEFAULT_OPTIONS
from zmqflow.transport.zeromq import ZmqTransport

# libzmq's default bound is 1000 events; each attempt here gives at least one
ATTEMPTS = 3000


class HangsUp:
    """A TCP listener that accepts and closes at once: every ZMTP handshake with it fails."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.close()
            self.accepted += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def round_trip(timeout_ms: int = 5000) -> bool:
    """One request and reply over tcp on the process's context (its I/O thread)."""
    rep, req = context().socket(zmq.REP), context().socket(zmq.REQ)
    try:
        for s in (rep, req):
            s.setsockopt(zmq.LINGER, 0)
        port = rep.bind_to_random_port("tcp://127.0.0.1")
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(b"ping")
        if not rep.poll(timeout_ms):
            return False
        rep.send(rep.recv())
        return bool(req.poll(timeout_ms)) and req.recv() == b"ping"
    finally:
        rep.close()
        req.close()


# a stalled I/O thread holds the monitor's lock that closing the connection takes: the thread
# method ends the run with every stack printed, where the signal method would wait forever
@pytest.mark.timeout(90, method="thread")
def test_a_connection_whose_events_nobody_reads_does_not_stall_the_others() -> None:
    peer = HangsUp()
    idle = asyncio.new_event_loop()  # never run: the connection's monitor is never read
    fast = dataclasses.replace(DEFAULT_OPTIONS, reconnect_ivl_ms=1, reconnect_ivl_max_ms=1)
    conn = ZmqTransport().connect(f"tcp://127.0.0.1:{peer.port}", b"unread", lambda frames: None,
                                  lambda state: None, loop=idle, options=fast, name="unread")
    try:
        assert round_trip()
        deadline = time.monotonic() + 60
        # the I/O thread goes on retrying (a stalled one would stop near the old bound)
        while peer.accepted < ATTEMPTS:
            assert time.monotonic() < deadline, f"the connection stopped retrying after {peer.accepted} attempts"
            time.sleep(0.01)
        assert round_trip(), "tcp on the process's context stalled behind an unread monitor"
    finally:
        conn.close()
        idle.close()
        peer.close()
