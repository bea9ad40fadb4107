"""Gradient averaging as an optax transformation: put it first in a chain.

``optax.chain(zmqflow.jax.distributed_gradients(), optax.adam(1e-3))`` averages the gradients
over the ranks before Adam sees them, so every rank applies the same update and the replicas stay
equal, as Horovod's ``DistributedOptimizer`` does. It works eagerly and inside ``jax.jit`` (the
allreduce runs as an ordered host callback). optax is imported when the transformation is made;
without optax the same ``(init, update)`` pair comes back as a plain NamedTuple, which optax and
hand-written loops accept alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import InvalidArgument
from .collectives import OPS, allreduce

__all__ = ["distributed_gradients", "DistributedGradients", "GradientTransformation"]


class GradientTransformation(NamedTuple):
    """optax's shape of a transformation, for when optax is not installed."""

    init: Any
    update: Any


def distributed_gradients(op: str = "mean", *, timeout: float | None = None) -> Any:
    """A gradient transformation whose update reduces the updates across ranks by ``op``
    (``mean`` by default; ``sum`` for a loss summed over the global batch). Stateless."""
    if op not in OPS:
        raise InvalidArgument(f"distributed_gradients: op must be one of {', '.join(OPS)}, got {op!r}")
    try:
        import optax
    except ImportError:  # pragma: no cover - optax is part of the [jax] extra
        optax = None

    def init_fn(params: Any) -> Any:
        del params
        return optax.EmptyState() if optax is not None else ()

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        return allreduce(updates, op, timeout=timeout), state

    if optax is None:  # pragma: no cover - optax is part of the [jax] extra
        return GradientTransformation(init_fn, update_fn)
    return optax.GradientTransformation(init_fn, update_fn)


def DistributedGradients(op: str = "mean", *, timeout: float | None = None) -> Any:  # noqa: N802 - Horovod's spelling
    """The same as :func:`distributed_gradients` (named as Horovod's ``DistributedOptimizer``)."""
    return distributed_gradients(op, timeout=timeout)
