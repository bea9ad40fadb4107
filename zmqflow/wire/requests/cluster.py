"""Requests of the services every task hosts (master, worker, ring) and of the catalog."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np

from .base import MAX_ITEMS, MAX_PARTS, Count, Dtype, Name, Request, RowRange, Shape, Spec, Step
from .ps import Empty

__all__ = ["WaitForCluster", "Stop", "Hello", "Goodbye", "Run", "Declare", "MarkReady", "Abandon", "Lookup",
           "Uninitialized", "Records", "Deposit", "Abort",
           "Join", "MASTER", "WORKER", "CATALOG", "RING", "OPEN"]

Task = Annotated[str, msgspec.Meta(min_length=1, max_length=128, description="a task name of 1..128 characters")]
Text = Annotated[str, msgspec.Meta(max_length=1 << 16, description="a text of at most 65536 characters")]


class OPEN(Request):
    """Marks an op that takes any map of arguments as keywords (``worker.echo``, ``worker.sink``)."""


class WaitForCluster(Request):
    """Wait until every task of the cluster answers."""

    timeout: Annotated[float, msgspec.Meta(gt=0, le=86400, description="a number of seconds in (0, 86400]")] = 30.0


class Stop(Request):
    """Ask a task to stop serving (``zmqflow stop``): it answers, then stops as on SIGTERM. Who asks
    is the caller's key (with keys), never a field."""

    reason: Annotated[str, msgspec.Meta(max_length=256, description="a reason of at most 256 characters")] = ""


SessionId = Annotated[str, msgspec.Meta(min_length=1, max_length=64, description="a session id of 1..64 characters")]


class Hello(Request):
    """A training session opened (sent to the ps tasks): it counts for the caller's task, which is
    its key's name with keys, never a field."""

    session: SessionId


class Goodbye(Request):
    """A training session closed; ``finished``: its task ended training, not a crash or a stop."""

    session: SessionId
    finished: bool = False


class Run(Request):
    """Call ``package.module:function(*args, **kwargs)`` from an allowed module."""

    function: Name
    args: Annotated[list[Any], msgspec.Meta(max_length=MAX_ITEMS, description="a list")] | None = None
    kwargs: Annotated[dict[str, Any], msgspec.Meta(max_length=MAX_ITEMS, description="a map")] | None = None


class Declare(Request):
    """Record (or return) a variable's placement; the reply's ``claim`` (or null) says whether
    this declarer is to create its parts. While another one holds the claim, it waits."""

    name: Name
    shape: Shape
    dtype: Dtype
    part_rows: Annotated[list[RowRange], msgspec.Meta(min_length=1, max_length=MAX_PARTS,
                                                      description="a list of 1..65536 row ranges")]
    part_bytes: Annotated[list[Count], msgspec.Meta(min_length=1, max_length=MAX_PARTS,
                                                    description="a list of 1..65536 byte counts")]
    device: Task | None = None
    policy: Annotated[str, msgspec.Meta(min_length=1, max_length=64, description="a policy name")] = "round_robin"
    optimizer: Spec | None = None
    initializer: Spec | None = None
    table: Spec | None = None
    has_value: bool = False  # the declarer holds an initial value to build parts from
    defaulted: bool = False  # it gave neither a value nor an initializer: a declaration with a value may take over


Claim = Annotated[str, msgspec.Meta(min_length=1, max_length=64, description="a claim token of 1..64 characters")]


class MarkReady(Request):
    """Every part of ``name`` exists: the holder of its ``claim`` (from ``declare``) makes it ready."""

    name: Name
    claim: Claim


class Abandon(Request):
    """The holder of the ``claim`` on a not-ready ``name`` gives it up: with ``keep``, the record
    stays for the next declarer (a shard was out); else it goes (a shard refused a part)."""

    name: Name
    claim: Claim
    keep: bool = False


class Lookup(Request):
    """A variable's record, waiting for it to be created when ``wait``."""

    name: Name
    wait: bool = True


class Uninitialized(Request):
    """Which of ``names`` are not ready."""

    names: Annotated[list[Name], msgspec.Meta(max_length=MAX_ITEMS, description="a list of names")]


class Records(Request):
    """Every ready record; with ``pending``, also those still being created."""

    pending: bool = False


Ring = Annotated[str, msgspec.Meta(min_length=1, max_length=256, description="a ring name of 1..256 characters")]
Seq = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1, description="an integer >= 0")]


class Deposit(Request):
    """One chunk from the left neighbour: ring, call, phase, step, chunk, sender, metadata, data."""

    ring: Ring
    seq: Seq
    phase: Annotated[str, msgspec.Meta(min_length=1, max_length=32, description="a phase name")]
    step: Count
    chunk: Count
    src: Count
    meta: Annotated[list[Any], msgspec.Meta(max_length=64, description="a list of at most 64 values")]
    data: np.ndarray


class Abort(Request):
    """Fail every pending take of one call with the error ``code`` names."""

    ring: Ring
    seq: Seq
    code: Annotated[str, msgspec.Meta(max_length=64, description="an error code")]
    message: Text
    details: Annotated[dict[str, Any], msgspec.Meta(max_length=64, description="a map")] | None = None


class Leave(Request):
    """A rank is done with a ring after call ``seq`` (-1: none): its going is not a death."""

    ring: Ring
    src: Count
    seq: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 63) - 1, description="an integer >= -1")]


class Join(Request):
    """Ask the coordinator for a place in the next ring generation."""

    task: Task
    generation: Count
    step: Step
    target: Count


MASTER: dict[str, type[Request]] = {"ping": Empty, "status": Empty, "cluster": Empty, "wait_for_cluster": WaitForCluster,
                                    "shutdown": Stop, "hello": Hello, "goodbye": Goodbye}
WORKER: dict[str, type[Request]] = {"ping": Empty, "echo": OPEN, "sink": OPEN, "run": Run}
CATALOG: dict[str, type[Request]] = {"ping": Empty, "declare": Declare, "mark_ready": MarkReady, "abandon": Abandon,
                                     "lookup": Lookup, "uninitialized": Uninitialized, "records": Records}
RING: dict[str, type[Request]] = {"ping": Empty, "deposit": Deposit, "abort": Abort, "leave": Leave, "status": Empty,
                                  "join": Join}


