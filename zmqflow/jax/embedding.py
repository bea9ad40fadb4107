"""Embedding tables on the ps shards, read and trained from JAX.

``lookup`` gives the rows of a batch of ids as a JAX array (each distinct id fetched once, from
the shard that owns it); differentiate the loss with respect to those rows and ``push`` the
gradient back: repeated ids are summed on the client, each shard gets its unique ids once, and
the table's own optimizer (server-side) applies them. Pushes from several ranks add up there.

    rows = table.lookup(ids)                        # (*ids.shape, dim)
    loss, g = jax.value_and_grad(loss_fn)(rows, y)  # g: (*ids.shape, dim)
    table.push(ids, g)

A model with many tables reads and pushes them all at once, one request a shard:
``lookup_many([user, item], [user_ids, item_ids])`` and ``push_many(tables, ids, grads)``.

Both calls talk to the shards, so they run outside ``jax.jit``; the jitted part takes the rows.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..bridge import runtime as rt
from ..client.blocking import Embedding as TableHandle
from ..errors import InvalidArgument
from ..state import init as zf_init
from ..state.sparse import unique_sum
from .arrays import is_tracer, narrow

__all__ = ["Embedding", "lookup_many", "push_many"]


class Embedding:
    """Get-or-create the table ``name`` (``num_embeddings`` rows of ``embedding_dim``; ``None``
    rows for a dynamic hash table) trained by ``optimizer``, a ``zmqflow.optim`` optimizer run on
    the shards (without one, a push adds what it is given: push ``-lr * grad``). Every rank may
    create the same table at once: the first declaration wins, the others attach to it (another
    shape or dtype is a VariableConflict). The other keywords are those of ``Session.embedding``.
    Needs ``zmqflow.jax.init()`` first.

    Without an ``initializer`` rows are drawn as flax's ``nn.Embed`` draws them: normal, stddev
    ``1/sqrt(embedding_dim)``, seeded by the crc32 of ``name`` so every process (and every run)
    builds the same rows. Zero rows would not do: in a dot-product model (DLRM) two zero rows give
    each other zero gradients, and training never starts."""

    def __init__(self, name: str, num_embeddings: int | None, embedding_dim: int, optimizer: Any = None, *,
                 partitions: Any = None, partition_strategy: str = "mod", dtype: Any = "float32",
                 initializer: Any = None, min_frequency: int = 1, capacity: int | None = None):
        session = rt.current().session
        if initializer is None:
            initializer = _default_initializer(name, embedding_dim)
        self.table: TableHandle = session.embedding(
            name, num_embeddings, embedding_dim, partitions=partitions, partition_strategy=partition_strategy,
            dtype=dtype, initializer=initializer, optimizer=optimizer, min_frequency=min_frequency, capacity=capacity)
        info = self.table.handle.info
        self.name: str = info.name
        self.num_embeddings: int | None = info.num_embeddings
        self.embedding_dim: int = info.dim
        self.dtype: np.dtype = info.dtype

    def _host(self, x: Any, what: str) -> np.ndarray:
        if is_tracer(x):
            raise InvalidArgument(f"{what} of embedding {self.name!r} talks to the shards, so it cannot be traced "
                                  f"by jax.jit (or grad, vmap): call it outside, and pass the rows in")
        return np.asarray(x)

    def lookup(self, ids: Any, *, create: bool = True) -> jax.Array:
        """The rows of ``ids`` (any integer shape): a JAX array of shape ``(*ids.shape, dim)``. Rows of
        a float64 table need ``jax_enable_x64`` unless float32 holds them exactly (InvalidArgument)."""
        return self._array(self.table.lookup(self._host(ids, "lookup"), create=create))

    def _array(self, rows: np.ndarray) -> jax.Array:
        return jnp.asarray(narrow(f"lookup of embedding {self.name!r}", "the rows", rows,
                                  "create the table with dtype float32"))

    def push(self, ids: Any, grads: Any) -> int:
        """Send the gradient of the looked-up rows (shape ``(*ids.shape, dim)``) to the table's
        optimizer; rows of repeated ids are summed first. Floating gradients of another precision
        are summed in at least float32, then cast to the table's dtype once: cast first, each of a hot
        id's gradients would be rounded to bfloat16 and the errors add up. Returns how many rows were updated."""
        return self.table.push(*self._pushed(ids, grads))

    def _pushed(self, ids: Any, grads: Any) -> tuple[np.ndarray, np.ndarray]:
        """(ids, gradients) as the table takes them: another floating precision summed, then cast."""
        g, i = self._host(grads, "push"), self._host(ids, "push")
        if g.dtype != self.dtype and _floating(g.dtype) and _floating(self.dtype):
            if g.shape == (*i.shape, self.embedding_dim):  # another shape: the table's push names it
                wide = np.float64 if max(g.dtype.itemsize, self.dtype.itemsize) >= 8 else np.float32
                i, g = unique_sum(i.reshape(-1), g.reshape(-1, self.embedding_dim).astype(wide))
            g = g.astype(self.dtype)
        return i, g

    def size(self) -> int:
        """Rows held over all shards."""
        return self.table.size()

    def __repr__(self) -> str:
        rows = "dynamic" if self.num_embeddings is None else self.num_embeddings
        return f"<zmqflow.jax.Embedding {self.name!r} {rows} x {self.embedding_dim} {self.dtype}>"


def lookup_many(tables: Sequence[Embedding], ids: Sequence[Any], *, create: bool = True) -> list[jax.Array]:
    """Each table's :meth:`Embedding.lookup` of its ids, in one request a shard for them all (a
    model's tables: one round trip, not one a table)."""
    _check_tables(tables, "lookup_many", ids)
    host = [t._host(x, "lookup") for t, x in zip(tables, ids)]
    rows = rt.current().session.lookup_many([t.table for t in tables], host, create=create)
    return [t._array(r) for t, r in zip(tables, rows)]


def push_many(tables: Sequence[Embedding], ids: Sequence[Any], grads: Sequence[Any]) -> list[int]:
    """Each table's :meth:`Embedding.push`, in one request a shard for them all; the rows each updated."""
    _check_tables(tables, "push_many", ids, grads)
    pushed = [t._pushed(x, g) for t, x, g in zip(tables, ids, grads)]
    return rt.current().session.push_many([t.table for t in tables], [i for i, _ in pushed], [g for _, g in pushed])


def _check_tables(tables: Any, what: str, ids: Sequence[Any], grads: Sequence[Any] | None = None) -> None:
    """InvalidArgument unless ``tables`` is a sequence of tables, with ids (and gradients) for each."""
    if isinstance(tables, Embedding) or not all(isinstance(t, Embedding) for t in tables):
        raise InvalidArgument(f"{what}: tables must be a sequence of zmqflow.jax.Embedding")
    for name, given in (("id arrays", ids), ("gradient arrays", grads)):
        if given is not None and len(given) != len(tables):
            raise InvalidArgument(f"{what}: {len(tables)} tables but {len(given)} {name}")


def _default_initializer(name: Any, dim: Any) -> zf_init.Initializer | None:
    """flax's ``nn.Embed`` default, N(0, 1/dim), seeded by the name; None for a name or dim the
    declaration refuses (it says what is wrong with them)."""
    if not isinstance(name, str) or not isinstance(dim, int) or dim < 1:  # as declare_embedding checks dim
        return None
    return zf_init.normal(stddev=1.0 / math.sqrt(dim), seed=zlib.crc32(name.encode()))


def _floating(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt.name == "bfloat16"
