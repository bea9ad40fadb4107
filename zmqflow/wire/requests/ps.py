"""Requests of the ``ps`` service: variables, embedding tables, checkpoints and the recovery fence.

Row ranges are part-local; ``start``/``stop`` of ``None`` mean the whole part (and are the only
choice for scalar variables). Values, gradients and rows are checked against the part (dtype,
shape, index range) by the shard's store, once; here only what is known of them beforehand.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

from .base import (MAX_ITEMS, MAX_PARTS, NAME_MAX, PATH_MAX, ArraySpec, Count, Dtype, Int, Item, Name, Part, Request, Row,
                   RowRange, Shape, Spec)

__all__ = [
    "Empty", "Create", "PullItem", "Pull", "BulkOffer", "PullBulk", "PushBulk", "RowsItem", "Assign", "Scatter",
    "SparseItem", "PartItem", "Push", "Save",
    "RestorePart", "Unfence", "Pair", "Sweep", "Drop", "EmbCreate", "EmbIds", "EmbLookup", "EmbPush",
    "LookupItem", "EmbLookupMany", "PushItem", "EmbPushMany", "MAX_TABLE_ITEMS", "EmbEvict",
    "EmbExport", "EmbRestore", "EmbExportDelta", "OPS",
]

Indices = Annotated[np.ndarray, ArraySpec(ndim=1, kinds="iu", what="a 1-D integer array")]
Rows2D = Annotated[np.ndarray, ArraySpec(ndim=2, what="a 2-D array")]
Slots = Annotated[dict[str, np.ndarray], msgspec.Meta(max_length=64, description="a map of slot name to array")]


class Empty(Request):
    """No arguments."""


class Create(Request):
    """Create a part unless it exists (``value`` set, or ``initializer`` run); conflicts are refused."""

    name: Name
    part: Part
    shape: Shape
    rows: RowRange
    dtype: Dtype
    num_parts: Annotated[int, msgspec.Meta(ge=1, le=MAX_PARTS, description="an integer in 1..65536")] = 1
    optimizer: Spec | None = None
    initializer: Spec | None = None
    value: np.ndarray | None = None


class PullItem(Item):
    name: Name
    part: Part
    start: Row | None
    stop: Row | None


PullItems = Annotated[list[PullItem], msgspec.Meta(max_length=MAX_ITEMS,
                                                   description="a list of [name, part, start, stop]")]


class Pull(Request):
    """Read rows of parts, in order; answered with one array per item."""

    items: PullItems


class BulkOffer(Request):
    """A bulk stream for the caller: ``pull`` carries transfers to it, ``push`` from it."""

    kind: Literal["pull", "push"] = "pull"


Dtypes = Annotated[list[Dtype], msgspec.Meta(max_length=MAX_ITEMS,
                                             description="each item's dtype, as the caller knows it")]
Sizes = Annotated[list[Count], msgspec.Meta(max_length=MAX_ITEMS,
                                            description="each item's byte count, as the caller knows it")]


class _Transfer(Request):
    """Rows of parts, in order, as transfer ``tag`` on the caller's bulk stream ``stream``
    (:mod:`zmqflow.transport.bulk`). ``dtypes`` and ``sizes`` say what the caller expects of each
    item: raw bytes carry neither, so a part that differs (re-created since the caller learned of
    it) is refused before a byte moves."""

    items: PullItems
    dtypes: Dtypes
    sizes: Sizes
    stream: Count
    tag: Count


class PullBulk(_Transfer):
    """Send the rows on the caller's bulk stream; answered with the byte count once they are sent."""


# a push's own learning rate, in place of each part's optimizer's (a worker's schedule); parts
# without an optimizer (a plain add) have none to replace
LearningRate = Annotated[float, msgspec.Meta(ge=0.0, le=1e30, description="a learning rate in 0..1e30")]


class PushBulk(_Transfer):
    """Gradients for rows of async parts, whose bytes come on the caller's push stream, each
    C-ordered in its part's dtype; answered as ``push``."""

    learning_rate: LearningRate | None = None


class RowsItem(Item):
    name: Name
    part: Part
    start: Row | None
    stop: Row | None
    value: np.ndarray


class Assign(Request):
    """Write rows of parts (all items checked before any is written)."""

    items: Annotated[list[RowsItem], msgspec.Meta(max_length=MAX_ITEMS,
                                                  description="a list of [name, part, start, stop, value]")]
    mode: Annotated[Literal["set", "add", "sub"], msgspec.Meta(description="one of set, add, sub")] = "set"


class Scatter(Request):
    """Rows by part-local index: ``add`` sums duplicates, ``update`` keeps the last."""

    name: Name
    part: Part
    indices: Indices
    rows: np.ndarray
    mode: Annotated[Literal["add", "update"], msgspec.Meta(description="one of add, update")] = "add"


class SparseItem(Item):
    name: Name
    part: Part
    indices: Indices
    rows: np.ndarray


class PartItem(Item):
    name: Name
    part: Part


class Push(Request):
    """Gradients through each part's optimizer (at ``learning_rate`` where given: a sync step at the
    rate of the push that completes it); sync parts need the pusher's ``step``. ``absent``:
    parts the pusher has no gradient for this step (as torch's ``grad is None``). A sync part counts
    it as one replica of its round, adding nothing to the sum; a round in which no replica had a
    gradient applies nothing, so the optimizer's slots stay as they were. Async parts ignore it.
    ``read``: rows to send back with the answer, as a ``pull`` of them would once the push (and
    its sync step) is applied: a small step's read-back in the push's own round trip."""

    dense: Annotated[list[RowsItem], msgspec.Meta(max_length=MAX_ITEMS,
                                                  description="a list of [name, part, start, stop, gradient]")] = []
    sparse: Annotated[list[SparseItem], msgspec.Meta(max_length=MAX_ITEMS,
                                                     description="a list of [name, part, indices, rows]")] = []
    absent: Annotated[list[PartItem], msgspec.Meta(max_length=MAX_ITEMS,
                                                   description="a list of [name, part]")] = []
    step: Int | None = None
    learning_rate: LearningRate | None = None
    read: PullItems = []


class Save(Request):
    """Write the shard to ``directory/file`` atomically."""

    directory: Annotated[str, msgspec.Meta(min_length=1, max_length=PATH_MAX, description="a path of 1..4096 characters")]
    file: Annotated[str, msgspec.Meta(min_length=1, max_length=255, description="a file name of 1..255 characters")]


class RestorePart(Request):
    """Put a part's value, optimizer slots, step counts and sync step back."""

    name: Name
    part: Part
    value: np.ndarray
    slots: Slots | None = None
    steps: np.ndarray | None = None
    sync_step: Count | None = None


class Unfence(Request):
    """Lift the fence of recovery ``epoch``."""

    epoch: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1, description="an integer >= 0")]


class Pair(Item):
    name: Name
    part: Part


class Sweep(Request):
    """Drop every part and table not in ``keep`` (fenced shards only)."""

    keep: Annotated[list[Pair], msgspec.Meta(max_length=MAX_ITEMS, description="a list of [name, part] pairs")]


class Drop(Request):
    """Drop the parts and tables of an abandoned declaration: those ``owner`` (the declarer that
    held the catalog's claim) made. The catalog's task sends it; clients may not."""

    items: Annotated[list[Pair], msgspec.Meta(max_length=MAX_PARTS, description="a list of [name, part] pairs")]
    owner: Annotated[str, msgspec.Meta(max_length=NAME_MAX, description="a caller's name of 0..1024 characters")]


class EmbCreate(Request):
    """Create a table part: ``static`` rows in the store, or a ``hash`` table."""

    name: Name
    part: Part
    kind: Annotated[Literal["static", "hash"], msgspec.Meta(description="a table kind: static or hash")]
    dim: Annotated[int, msgspec.Meta(ge=1, le=1 << 31, description="an integer >= 1")]
    dtype: Dtype
    rows: Row = 0
    num_embeddings: Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1, description="an integer >= 1")] | None = None
    num_parts: Annotated[int, msgspec.Meta(ge=1, le=MAX_PARTS, description="an integer in 1..65536")] = 1
    optimizer: Spec | None = None
    initializer: Spec | None = None
    min_frequency: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31), description="an integer >= 1")] = 1
    capacity: Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1, description="an integer >= 1")] | None = None


class EmbIds(Request):
    """Names one table part (``emb_stats``)."""

    name: Name
    part: Part


class EmbLookup(Request):
    """Rows of part-local ``ids`` (a hash table admits new ids when ``create``)."""

    name: Name
    part: Part
    ids: Indices
    create: bool = True


class EmbPush(Request):
    """Sparse gradients of unique part-local ``ids``."""

    name: Name
    part: Part
    ids: Indices
    grads: Rows2D
    step: Count | None = None


# Parts one emb_lookup_many or emb_push_many names: a model's tables on one shard (a few hundred
# at most), each a part or a few. Arrays of 16 KiB or more take a frame each, and a push item
# carries two: 1024 items keep a request and its reply within the codec's 4096 frames.
MAX_TABLE_ITEMS = 1024


class LookupItem(Item):
    name: Name
    part: Part
    ids: Indices


class EmbLookupMany(Request):
    """``emb_lookup`` of several table parts in one request: one array per item, in order. Every
    item is checked before any is looked up (a lookup with ``create`` changes a hash table)."""

    items: Annotated[list[LookupItem], msgspec.Meta(min_length=1, max_length=MAX_TABLE_ITEMS,
                                                    description="a list of 1..1024 [name, part, ids]")]
    create: bool = True


class PushItem(Item):
    name: Name
    part: Part
    ids: Indices
    grads: Rows2D


class EmbPushMany(Request):
    """``emb_push`` of several table parts in one request, in order: the rows applied per item.
    Every item is checked before any is applied."""

    items: Annotated[list[PushItem], msgspec.Meta(min_length=1, max_length=MAX_TABLE_ITEMS,
                                                  description="a list of 1..1024 [name, part, ids, grads]")]
    step: Count | None = None


class EmbEvict(Request):
    """Drop rows of a hash table not updated for a number of pushes or seconds."""

    name: Name
    part: Part
    older_than_step: Count | None = None
    older_than_seconds: Annotated[float, msgspec.Meta(ge=0, le=1e18,
                                                      description="a number of seconds >= 0")] | None = None


class EmbExport(Request):
    """A page of rows ``[start, start + limit)``, or for a dynamic table with ``after``, the
    ``limit`` rows of the lowest ids above it: a page that follows the last id it returned sees
    every row held all along exactly once, whatever is made or dropped between pages."""

    name: Name
    part: Part
    start: Row = 0
    after: Int | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=1 << 24, description="an integer in 1..16777216")] = 1 << 16


class EmbRestore(Request):
    """Put rows of a hash table back (ids, values, slots, step counts) and ids pending admission
    with their sightings. ``replace``: the part first drops every row and sighting it holds (the
    first of a restore's calls to a part: the part then holds exactly the checkpoint's rows)."""

    name: Name
    part: Part
    ids: Indices
    values: Rows2D
    slots: Slots | None = None
    steps: np.ndarray | None = None
    changed: Indices | None = None
    clock: Count | None = None
    replace: bool = False
    pending_ids: Indices | None = None
    pending_counts: Indices | None = None


class EmbExportDelta(Request):
    """Write the rows of a hash table part changed at steps >= ``since``, and the ids it dropped
    since, to ``directory/file`` (safetensors)."""

    name: Name
    part: Part
    since: Count
    directory: Annotated[str, msgspec.Meta(min_length=1, max_length=PATH_MAX, description="a path of 1..4096 characters")]
    file: Annotated[str, msgspec.Meta(min_length=1, max_length=255, description="a file name of 1..255 characters")]


OPS: dict[str, type[Request]] = {
    "ping": Empty, "status": Empty, "global_step": Empty, "variables": Empty,
    "create": Create, "pull": Pull, "bulk_offer": BulkOffer, "pull_bulk": PullBulk,
    "push_bulk": PushBulk, "assign": Assign, "scatter": Scatter, "push": Push,
    "save": Save, "restore_part": RestorePart, "emb_restore": EmbRestore,
    "fence": Empty, "unfence": Unfence, "sweep": Sweep, "drop": Drop,
    "emb_create": EmbCreate, "emb_lookup": EmbLookup, "emb_push": EmbPush,
    "emb_lookup_many": EmbLookupMany, "emb_push_many": EmbPushMany, "emb_stats": EmbIds,
    "emb_evict": EmbEvict, "emb_export": EmbExport, "emb_export_delta": EmbExportDelta,
}
