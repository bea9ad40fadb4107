"""The sending end of a task's pull streams (:mod:`zmqflow.server.bulk_listener`): a transfer is
sent whole by a pool thread, from the views themselves."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

from ..transport.bulk_sender import Sender

__all__ = ["BulkConn"]


class BulkConn(Sender):
    """An open pull stream, and whose it is."""

    def __init__(self, handle: int, owner: str, sock: socket.socket, pool: ThreadPoolExecutor):
        super().__init__(f"bulk stream {handle}", sock, pool)
        self.handle, self.owner = handle, owner
