"""The sending end of a task's pull streams (:mod:`zmqflow.server.bulk_listener`): a transfer is
sent whole by a pool thread, from the views themselves.

Transfers wait their turn on a stream, and a client that reads nothing keeps them waiting until
their deadlines: what waits is capped per stream (``MAX_QUEUED`` transfers, ``QUEUED_ITEMS``
items in all, though a transfer alone may have more), and each holds its items in a few bytes
(:class:`Gather`), its views made only when its turn comes.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

from ..errors import ResourceExhausted
from ..transport.bulk_sender import Gather, Sender

__all__ = ["BulkConn", "MAX_QUEUED", "QUEUED_ITEMS"]

MAX_QUEUED = 1024  # transfers waiting on one stream (a client asks for a pull's all at once)
QUEUED_ITEMS = 1 << 18  # their items in all: a transfer alone may have more (up to a request's MAX_ITEMS)


class BulkConn(Sender):
    """An open pull stream, and whose it is."""

    def __init__(self, handle: int, owner: str, sock: socket.socket, pool: ThreadPoolExecutor):
        super().__init__(f"bulk stream {handle}", sock, pool)
        self.handle, self.owner = handle, owner
        self.details = {"bulk_stream": handle}  # the client closes its end on an error naming it
        self.queued = 0  # transfers asked for and not yet sent (the one sending included)
        self.queued_items = 0

    async def transfer(self, tag: int, rows: Gather, deadline: float | None) -> int:
        """``rows`` sent whole as transfer ``tag`` once the stream is free; refused with
        ResourceExhausted, changing nothing, where the stream has too much waiting on it."""
        if self.queued >= MAX_QUEUED or (self.queued and self.queued_items + rows.count > QUEUED_ITEMS):
            raise ResourceExhausted(f"bulk stream {self.handle}: {self.queued} transfers of {self.queued_items} "
                                    f"items wait to be sent, the cap is {MAX_QUEUED} transfers and "
                                    f"{QUEUED_ITEMS} items; this one has {rows.count}")
        self.queued += 1
        self.queued_items += rows.count
        try:
            return await self.send(tag, rows, deadline)
        finally:
            self.queued -= 1
            self.queued_items -= rows.count
