"""Several connections per peer for large requests (``ZMQFLOW_STREAMS``).

One TCP connection is served by one ZeroMQ I/O thread and one kernel flow: on a fast link (tens of
Gbit/s), or where the network caps each flow, one stream cannot fill the link. With ``streams``
above 1 an :class:`~zmqflow.rpc.RpcClient` opens up to that many connections to a peer, the extra
ones under their own routing identity (``<identity>~<k>``), and deals calls that move at least
``STREAM_MIN_BYTES`` over them in turn: a large request, or a read whose caller says its reply
will be large (``size=``: pulls and embedding lookups do); other calls (and their batch
envelopes) keep to the first. Each extra connection is a peer of its own to the client (its
state, its calls in flight, its retries, which stay on it so the server's duplicate record sees
them), so nothing else about a call changes. The server needs nothing: to it each is one more
DEALER. Pair it with ``ZMQFLOW_IO_THREADS`` so the streams are served by different threads.

Requests on different streams may be run in another order than they were sent. Calls a caller
awaits one after the other are unaffected; requests started together without waiting (the slices
of one pull or push, each on its own rows) never depended on an order.

Off by default (1): on the 2-core machine of ``bench/README.md``, where both ends' copies
already keep both cores busy, two streams (with two I/O threads) moved 100 MB pushes at 1.5-1.6
GB/s against 1.8-2.1 with one. inproc endpoints never use extra streams.
"""

from __future__ import annotations

from ..env import bounded_int
from ..errors import ConfigError

__all__ = ["STREAMS_ENV", "STREAM_MIN_BYTES", "MAX_STREAMS", "Streams", "configured_streams"]

STREAMS_ENV = "ZMQFLOW_STREAMS"
STREAM_MIN_BYTES = 1 << 20  # smaller requests gain nothing from another flow and keep their order
MAX_STREAMS = 16


def configured_streams(environ: dict[str, str] | None = None) -> int:
    """The streams ``ZMQFLOW_STREAMS`` asks for (1 when unset); ConfigError names a bad value."""
    return bounded_int(STREAMS_ENV, 1, MAX_STREAMS, 1, environ)


class Streams:
    """Which stream each request to a peer takes: large ones in turn, small ones the first."""

    def __init__(self, count: int):
        if not 1 <= count <= MAX_STREAMS:
            raise ConfigError(f"streams must be from 1 to {MAX_STREAMS}, got {count!r}")
        self.count = count
        self._next: dict[str, int] = {}

    def pick(self, endpoint: str, nbytes: int) -> int:
        """The stream (0 = the peer's first connection) for a request of ``nbytes`` to ``endpoint``."""
        if self.count == 1 or nbytes < STREAM_MIN_BYTES or endpoint.startswith("inproc://"):
            return 0
        k = self._next.get(endpoint, 0)
        self._next[endpoint] = (k + 1) % self.count
        return k

    @staticmethod
    def key(endpoint: str, stream: int) -> str:
        """The client's key for a stream's connection (the endpoint itself for the first)."""
        return endpoint if stream == 0 else f"{endpoint}~{stream}"

    @staticmethod
    def identity(identity: bytes, stream: int) -> bytes:
        """The routing identity a stream's connection presents (the client's own for the first)."""
        return identity if stream == 0 else identity + b"~%d" % stream
