"""vmap and reverse-mode autodiff through the collectives that run inside a trace.

A collective traced by JAX is an ordered ``io_callback``, which has neither a batching rule nor a
derivative: JAX refuses ``vmap`` and ``grad`` of it with an untyped ValueError. Both are simple
here. A collective works leaf by leaf and element by element, so under ``vmap`` it runs once on
the batched leaves (every rank maps over the same batch). Its derivative is itself a collective
of the cotangents, which each collective supplies (``vjp``). Forward mode (``jvp``, ``jacfwd``) stays
unsupported: JAX's ``custom_vjp`` defines none, and says so with a TypeError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import custom_batching

__all__ = ["transformable", "cotangents"]

Leaves = tuple[Any, ...]


def transformable(raw: Callable[[Leaves], Leaves], vjp: Callable[[Leaves], Leaves],
                  gathered: bool = False) -> Callable[[Leaves], Leaves]:
    """``raw`` (a tuple of leaves to a tuple of results, any shapes) with a vmap rule and the
    reverse-mode derivative ``vjp`` (the results' cotangents to the leaves'). ``gathered``: each
    result has a new leading rank axis, which comes before a mapped batch axis in what ``raw`` gives."""

    @custom_batching.custom_vmap
    def mapped(xs: Leaves) -> Leaves:
        return raw(xs)

    @mapped.def_vmap
    def rule(axis_size: int, in_batched: Sequence[Any], xs: Leaves) -> tuple[Leaves, Leaves]:
        del axis_size
        batched = tuple(in_batched[0])
        out = mapped(xs)  # itself again, not raw: an enclosing vmap gets its own rule
        if gathered:  # vmap wants the batch axis first
            out = tuple(jnp.moveaxis(o, 1, 0) if b else o for o, b in zip(out, batched))
        return out, batched

    @jax.custom_vjp
    def run(xs: Leaves) -> Leaves:
        return mapped(xs)

    def fwd(xs: Leaves) -> tuple[Leaves, None]:
        return mapped(xs), None

    def bwd(_: None, cts: Leaves) -> tuple[Leaves]:
        return (vjp(cts),)

    run.defvjp(fwd, bwd)
    return run


def cotangents(cts: Leaves, collective: Callable[[list[Any]], list[Any]]) -> Leaves:
    """``collective`` run on the cotangents that carry values; integer and bool leaves have none
    (JAX's float0), so theirs stay ``None`` (zero)."""
    live = [i for i, c in enumerate(cts) if c.dtype != jax.dtypes.float0]
    out: list[Any] = [None] * len(cts)
    for i, r in zip(live, collective([cts[i] for i in live])):
        out[i] = r
    return tuple(out)
