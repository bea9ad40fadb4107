"""What the transport benchmark measures: sizes, transports, targets, and how many messages."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..report import KiB, MiB
from ..stats import clamp

__all__ = [
    "DEFAULT_SIZES",
    "FULL",
    "LAT_TARGET",
    "SMALL_TPUT_TARGET",
    "TPUT_TARGET_INPROC",
    "LAT_TARGET_MAX_BYTES",
    "QUICK",
    "QUICK_SIZES",
    "TPUT_TARGET",
    "TPUT_TARGET_MIN_BYTES",
    "TRANSPORTS",
    "Plan",
    "parse_size",
    "parse_sizes",
    "tensor",
]

DEFAULT_SIZES: tuple[int, ...] = (64, 4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB)
QUICK_SIZES: tuple[int, ...] = DEFAULT_SIZES[:-1]
TRANSPORTS: tuple[str, ...] = ("inproc", "ipc", "tcp")

TPUT_TARGET = 0.9  # zmqflow / raw throughput, for messages >= TPUT_TARGET_MIN_BYTES (ipc, tcp)
TPUT_TARGET_INPROC = 0.8  # the same, inproc: client and server share one process and one GIL
TPUT_TARGET_MIN_BYTES = MiB
SMALL_TPUT_TARGET = 0.5  # zmqflow / raw throughput, for messages <= LAT_TARGET_MAX_BYTES
LAT_TARGET = 1.3  # zmqflow / raw p50 latency, for messages <= LAT_TARGET_MAX_BYTES
LAT_TARGET_MAX_BYTES = 64


@dataclass(frozen=True)
class Plan:
    """How much to measure. Message counts are derived from byte budgets, then clamped."""

    reps: int
    tput_bytes: int  # payload per throughput measurement
    tput_min_msgs: int
    tput_max_msgs: int
    lat_bytes: int  # payload (both ways) per latency measurement
    lat_min: int
    lat_max: int
    memcpy_bytes: int
    tput_min_s: float = 0.0  # a throughput measurement lasts at least this long (see ``tput_msgs``)
    window_bytes: int = 128 * MiB  # at most this much payload in flight
    max_window: int = 64
    min_window: int = 2

    def window(self, size: int) -> int:
        return clamp(self.window_bytes // size, self.min_window, self.max_window)

    def tput_msgs(self, size: int, per_msg_s: float = 0.0) -> int:
        """Messages a throughput measurement sends: ``tput_bytes`` of payload, and, where the
        warm-up found ``per_msg_s`` seconds a message (the slower side's), at least enough for
        ``tput_min_s``. A byte budget alone leaves inproc's big messages, which move no bytes (a
        pointer each), a measurement of a millisecond or two: noise, not throughput."""
        timed = int(self.tput_min_s / per_msg_s) + 1 if per_msg_s > 0 else 0
        return clamp(max(self.tput_bytes // size, timed), max(self.tput_min_msgs, 2 * self.window(size)),
                     self.tput_max_msgs)

    def lat_iters(self, size: int) -> int:
        return clamp(self.lat_bytes // (2 * size), self.lat_min, self.lat_max)

    def memcpy_copies(self, size: int, batches: int) -> int:
        """Copies per memcpy batch: ``memcpy_bytes`` over all batches, 3..20000 a batch."""
        return clamp(self.memcpy_bytes // (size * batches), 3, 20000)


FULL = Plan(reps=5, tput_bytes=1 << 30, tput_min_msgs=16, tput_max_msgs=20000, lat_bytes=512 * MiB, lat_min=10,
            lat_max=2000, memcpy_bytes=512 * MiB, tput_min_s=0.2)
QUICK = Plan(reps=3, tput_bytes=96 * MiB, tput_min_msgs=8, tput_max_msgs=3000, lat_bytes=32 * MiB, lat_min=5,
             lat_max=300, memcpy_bytes=64 * MiB, tput_min_s=0.05)


def tensor(size: int) -> np.ndarray:
    """The float32 array of ``size`` bytes that is sent."""
    if size <= 0 or size % 4:
        raise ValueError(f"tensor size must be a positive multiple of 4 bytes (float32), got {size}")
    return np.arange(size // 4, dtype=np.float32)


def parse_size(text: str) -> int:
    """``64``, ``4K``/``4KiB``, ``1M``/``1MiB``, ``1G`` -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", KiB), ("M", MiB), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise ValueError(f"malformed size {text!r}: expected e.g. 64, 4K, 1M") from None
    if value <= 0 or value % 4:
        raise ValueError(f"size {text!r} must be a positive multiple of 4 bytes")
    return value


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes (``64,4K,1M``) -> bytes each, blanks skipped; ValueError
    naming the first malformed one."""
    return [parse_size(s) for s in text.split(",") if s.strip()]
