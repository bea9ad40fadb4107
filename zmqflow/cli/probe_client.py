"""The client of the commands that only ask tasks how they are (``status``, ``stop``).

Their replies are small maps (a status, a ping), yet they come from whatever answers at a task's
address. The runtime's default client takes frames up to 4 GiB, as tensors need; these commands
take at most :data:`PROBE_MAX_BYTES` a frame and a message, so a peer that answers with far more
is cut off by libzmq (the task then shows as unreachable) before the reply is held in memory.
"""

from __future__ import annotations

import dataclasses
import uuid

from ..rpc import RpcClient
from ..transport.curve import Keys
from ..transport.options import DEFAULT_OPTIONS, SocketOptions
from ..wire import Limits

__all__ = ["PROBE_MAX_BYTES", "PROBE_LIMITS", "PROBE_OPTIONS", "probe_client"]

# A status reply is a few KiB; the codec's header limit (4 MiB) stays below this.
PROBE_MAX_BYTES = 8 << 20
# No reply of these ops carries tensor frames: a few frames bound what a peer can make us keep.
PROBE_FRAMES = 16
PROBE_LIMITS = Limits(max_frame_bytes=PROBE_MAX_BYTES, max_frames=PROBE_FRAMES, max_message_bytes=PROBE_MAX_BYTES)
PROBE_OPTIONS: SocketOptions = dataclasses.replace(DEFAULT_OPTIONS, max_msg_bytes=PROBE_MAX_BYTES,
                                                   max_msg_parts=PROBE_FRAMES + 1)


def probe_client(prefix: str, timeout: float, keys: Keys | None = None, source: str = "") -> RpcClient:
    """A client named ``prefix-<random>`` that refuses replies over :data:`PROBE_MAX_BYTES`."""
    return RpcClient(identity=f"{prefix}-{uuid.uuid4().hex[:8]}", source=source, default_timeout=timeout,
                     keys=keys, limits=PROBE_LIMITS, options=PROBE_OPTIONS)
