"""How much state one request may make a shard or the catalog hold, checked before allocating.

A peer's declaration is untrusted: a shape of 2**40 elements must be refused with a typed error
before any record is written or any byte allocated, not discovered as a ``MemoryError`` halfway.
The defaults are sized for real models (a single tensor of several GiB, a 10M x 64 table over
four shards); the shard's byte budget defaults to the machine's physical memory.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..errors import InvalidArgument, ResourceExhausted

__all__ = ["StateLimits", "DEFAULT_STATE_LIMITS", "physical_memory", "check_variable", "check_count", "table_capacity"]


def physical_memory() -> int:
    """Bytes of RAM on this machine (64 GiB when the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 64 << 30


@dataclass(frozen=True, slots=True)
class StateLimits:
    """Caps on what variables, shards, the catalog and dynamic tables hold."""

    max_variable_elements: int = 1 << 36  # one variable, all parts: 64 Gi elements (256 GiB of float32)
    max_variable_bytes: int = 256 << 30  # one variable's value, all parts
    max_shard_bytes: int = field(default_factory=physical_memory)  # values and optimizer slots held by one shard
    max_variables: int = 1 << 18  # names in the catalog; parts and tables on one shard
    table_capacity: int = 1 << 24  # rows per dynamic table part when the table names no capacity
    max_table_capacity: int = 1 << 31  # the largest capacity a dynamic table part may ask for
    max_pending_admission: int = 1 << 20  # ids counted towards admission per dynamic table part


DEFAULT_STATE_LIMITS = StateLimits()


def check_variable(name: str, shape: tuple[int, ...] | list[int], itemsize: int, limits: StateLimits) -> int:
    """The variable's value bytes, or ResourceExhausted naming it, its size and the limit."""
    if math.prod(max(1, d) for d in shape) * max(1, itemsize) >= 1 << 63:  # numpy cannot index it, empty or not
        raise InvalidArgument(f"variable {name!r}: shape {list(shape)} is too large for an array, even with no "
                              "elements", name=name)
    elements = math.prod(shape)
    if elements > limits.max_variable_elements:
        raise ResourceExhausted(
            f"variable {name!r}: shape {list(shape)} has {elements} elements, over the limit of "
            f"{limits.max_variable_elements} per variable", name=name, elements=elements,
            limit=limits.max_variable_elements)
    nbytes = elements * itemsize
    if nbytes > limits.max_variable_bytes:
        raise ResourceExhausted(
            f"variable {name!r}: shape {list(shape)} needs {nbytes} bytes, over the limit of "
            f"{limits.max_variable_bytes} bytes per variable", name=name, bytes=nbytes, limit=limits.max_variable_bytes)
    return nbytes


def check_count(name: str, count: int, limit: int, where: str) -> None:
    """ResourceExhausted when ``where`` already holds ``limit`` variables."""
    if count >= limit:
        raise ResourceExhausted(f"variable {name!r}: {where} already holds {count} variables, the limit",
                                name=name, limit=limit)


def table_capacity(name: str, capacity: int | None, row_bytes: int, limits: StateLimits) -> int:
    """The rows a dynamic table part may hold: ``capacity`` if it is within the limits (else
    ResourceExhausted), or the default capacity, lowered so that a full part fits the shard's
    byte budget. ``row_bytes``: one row with its optimizer slots and bookkeeping."""
    if row_bytes > min(limits.max_shard_bytes, limits.max_variable_bytes):
        raise ResourceExhausted(
            f"embedding {name!r}: one row takes {row_bytes} bytes, over the limit of "
            f"{min(limits.max_shard_bytes, limits.max_variable_bytes)} bytes per variable and per shard", name=name,
            bytes=row_bytes, limit=min(limits.max_shard_bytes, limits.max_variable_bytes))
    if capacity is None:
        return max(1, min(limits.table_capacity, limits.max_shard_bytes // max(1, row_bytes)))
    if capacity > limits.max_table_capacity or capacity * row_bytes > limits.max_shard_bytes:
        raise ResourceExhausted(
            f"embedding {name!r}: capacity {capacity} rows of {row_bytes} bytes is over the limit of "
            f"{limits.max_table_capacity} rows and {limits.max_shard_bytes} bytes per part", name=name,
            limit=limits.max_table_capacity)
    return capacity
