"""A push's dense updates, applied together: one C call for each optimizer over all their parts.

A push of a model of many small variables (a ResNet has ~160 parameter tensors, a transformer
hundreds) paid a shard more for the Python around each part's update (the store's and the
optimizer's call chain, Adam's per-row step counts and bias lookups, each a few numpy calls)
than for the update itself. Here the parts whose update the C loops take are grouped by what
they run (a plain add, SGD, momentum, Adagrad or Adam at one setting) and each group is one
call (:func:`.kernels.axpy_many` and its siblings), with the bits each part's own update would
have. Everything else, a group the C call refuses (nothing written then) and the Adam parts
past its bias table of 65536 steps go the one-part way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import kernels
from .optim import SGD, Adagrad, Adam, Momentum, bias_table
from .store import Part

__all__ = ["Update", "apply_all"]

# (part, {(start, stop): gradient}, sparse or None, the push's learning rate or None)
Update = tuple[Part, dict[tuple[int, int], np.ndarray], Any, "float | None"]
_PLAIN = ("add", 1.0)  # no optimizer: y += x is axpy at 1 (times one is exact)
_KINDS = (SGD, Momentum, Adagrad, Adam)  # exactly these: a subclass may update otherwise


def apply_all(updates: list[Update], one: Callable[[Part, dict, Any, "float | None"], None]) -> None:
    """Apply every update once: the fused ones by group, the rest (and a refused group) by
    ``one``, the one-part way. A push names each part once, so their order does not matter."""
    if len(updates) < 2:  # nothing to share a call with
        for u in updates:
            one(*u)
        return
    groups: dict[Any, tuple[list[Update], list[list[np.ndarray]]]] = {}
    for u in updates:
        planned = _plan(u)
        if planned is None:
            one(*u)
            continue
        group = groups.get(planned[0])
        if group is None:
            group = groups[planned[0]] = ([], [[] for _ in planned[1]])
        group[0].append(u)
        for column, a in zip(group[1], planned[1]):
            column.append(a)
    planned = None
    for key, (members, columns) in groups.items():
        left = _run(key, columns)
        columns.clear()  # the views go: a part's ``own`` below must not take them for a pull's and copy
        for i in range(len(members)) if left is None else left:
            one(*members[i])


def _plan(u: Update) -> tuple[Any, tuple[np.ndarray, ...]] | None:
    """The group key and the arrays of an update the C loops take, None for the one-part way.
    Makes the part own its value first (``Part.own``): the arrays are views of what is written."""
    p, dense, sparse, rate = u
    if sparse is not None or len(dense) != 1 or p.dtype not in kernels.FUSED:
        return None
    opt = p.optimizer
    kind = type(opt)
    if opt is not None and kind not in _KINDS:
        return None
    ((a, b), grad), = dense.items()
    if grad.dtype != p.dtype or not grad.flags.c_contiguous:  # misaligned is fine: the kernels copy it
        return None
    p.own()
    whole = not p.full_shape or (a == 0 and b == p.nrows)
    value = p.value if whole else p.value[a:b]
    if opt is None:
        return _PLAIN, (value, grad)
    opt = opt.at(rate)
    if kind is SGD:
        return ("sgd", -opt.learning_rate), (value, grad)
    if len(p.slots) != len(opt.slot_names):
        return None
    if kind is not Adam:  # one slot: momentum's or Adagrad's accumulator
        state = p.slots[opt.slot_names[0]]
        return (kind.kind, opt, p.dtype), (value, grad, state if whole else state[a:b])
    if p.steps is None:
        return None
    m, v = p.slots["m"], p.slots["v"]
    rows = slice(a, b) if p.full_shape else slice(0, 1)
    if not whole:
        m, v = m[a:b], v[a:b]
    return ("adam", opt, p.dtype), (value, grad, m, v, p.steps[rows])


def _run(key: Any, columns: list[list[np.ndarray]]) -> list[int] | None:
    """One group's C call: the members it left as they were, None where it refused (none written)."""
    kind, opt = key[0], key[1]
    if kind in ("add", "sgd"):
        done = kernels.axpy_many(columns[0], columns[1], opt)
    elif kind == "momentum":
        done = kernels.momentum_many(*columns, opt.learning_rate, opt.momentum, opt.nesterov)
    elif kind == "adagrad":
        done = kernels.adagrad_many(*columns, opt.learning_rate)
    else:  # Adam leaves out the parts past its bias table: the one-part way computes their rates
        table = bias_table(opt.beta1, opt.beta2)
        return kernels.adam_many(*columns, table, opt.beta1, opt.beta2, opt.epsilon, opt.learning_rate)
    return [] if done else None
