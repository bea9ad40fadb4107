"""``DistributedOptimizer``: a torch optimizer whose step sees every rank's gradients.

As Horovod does, it returns an instance of a subclass of the wrapped optimizer's class made on the
fly, sharing the wrapped one's parameter groups and state: ``isinstance`` checks, LR schedulers,
``state_dict()``/``load_state_dict()``, ``param_groups`` and ``zero_grad()`` behave as the
optimizer's own. Use the returned object from then on.

``backend='ring'`` (:class:`RingOptimizerMixin`): gradients are averaged over the ring in buckets
that start during backward (:mod:`.buckets`), then the wrapped optimizer steps on every rank with
the same averaged gradients, so ranks that start equal stay bit-for-bit equal.
``backend='ps'`` (:mod:`.ps_optimizer`): parameters live on the ps shards, updated there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..bridge import runtime as _runtime
from ..errors import ConfigError, InvalidArgument
from ..observe.progress import counts_steps
from .buckets import GradientBuckets
from .collectives import ring
from .ps_optimizer import PsOptimizerMixin, refuse_unplanned
from .wrapped import SharesState

__all__ = ["DistributedOptimizer", "RingOptimizerMixin", "BACKENDS"]

BACKENDS = ("ring", "ps")


class RingOptimizerMixin(SharesState):
    """Methods of the torch optimizer subclass for ``backend='ring'``."""

    def init_distributed(self, named: list[tuple[str, torch.Tensor]], bucket_bytes: int, op: str, passes: int,
                  timeout: float, in_backward: bool = False) -> None:
        self._zf_buckets = GradientBuckets(named, ring(), bucket_bytes=bucket_bytes, op=op, passes=passes,
                                           timeout=timeout, in_backward=in_backward)
        self._zf_synced = False
        self._zf_skip = False
        self._zf_planned = frozenset(id(p) for _, p in named)

    @property
    def buckets(self) -> GradientBuckets:
        """The gradient buckets (their plan, and the order the last step started them)."""
        return self._zf_buckets

    def synchronize(self) -> None:
        """Finish this step's allreduces: every ``.grad`` holds the average over the ranks (where
        backward already did, ``average_in_backward``, nothing more is sent). Call it before reading
        or clipping gradients, then ``step()`` inside :meth:`skip_synchronize`."""
        self._zf_buckets.synchronize()
        self._zf_synced = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block uses the gradients as they are (after a ``synchronize()``)."""
        self._zf_skip = True
        try:
            yield
        finally:
            self._zf_skip = False

    @counts_steps
    def step(self, closure: Any = None) -> Any:
        """Average the gradients (unless backward or :meth:`synchronize` already did), then step.
        A ``closure`` runs first (its backward feeds the buckets); the wrapped step gets none."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._zf_skip and (not self._zf_synced or self._zf_buckets.in_flight):
            self.synchronize()
        refuse_unplanned(self, self._zf_planned)
        self._zf_synced = False
        super().step()  # type: ignore[misc]
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._zf_buckets.in_flight:
            raise InvalidArgument("zero_grad() was called after backward() but before step() or synchronize(): the "
                                  "gradients' allreduce is in flight; call step() (or synchronize()) first")
        self._zf_buckets.take_average()  # the averaged gradients go: the next backward starts a step
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters (this optimizer no longer averages)."""
        self._zf_buckets.remove_hooks()


RingOptimizerMixin.step.hooked = True  # type: ignore[attr-defined]  # torch must not wrap it again

_classes: dict[tuple[type, type], type] = {}


def _subclass(optimizer: torch.optim.Optimizer, mixin: type) -> Any:
    """An instance of ``mixin`` + ``type(optimizer)`` sharing ``optimizer``'s attributes."""
    base = type(optimizer)
    cls = _classes.get((mixin, base))
    if cls is None:
        cls = _classes[(mixin, base)] = type(base.__name__, (mixin, base), {"__module__": __name__})
    obj = cls.__new__(cls)
    # what was set on the instance over a method (a learning-rate scheduler made before wrapping
    # puts a counting ``step`` there, which steps the plain optimizer) must not hide this class's
    shadowing = {k for k, v in optimizer.__dict__.items() if callable(v) and callable(getattr(cls, k, None))}
    obj.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in shadowing})
    obj.made_from(optimizer)
    if "step" in shadowing:
        # code that kept the wrapped optimizer (that scheduler) steps this one too; the scheduler
        # warns once that the step it counted was replaced, as it was
        optimizer.step = obj.step  # type: ignore[method-assign]
    return obj


def _named(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, Any]] | None) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's trainable parameters in registration order, with their names (given, or by place)."""
    names: dict[int, str] | None = None
    if named_parameters is not None:
        names = {}
        seen: set[str] = set()
        for item in named_parameters:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise InvalidArgument("named_parameters must be (name, parameter) pairs, as module.named_parameters() gives")
            name, p = item
            if name in seen:
                raise InvalidArgument(f"named_parameters repeats the name {name!r}")
            seen.add(name)
            names[id(p)] = str(name)
    out = []
    unnamed = 0
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if not p.requires_grad:
                continue
            if names is None:
                out.append((f"group{g}.param{i}", p))
            elif id(p) in names:
                out.append((names[id(p)], p))
            else:
                unnamed += 1
    if unnamed:
        raise InvalidArgument(f"named_parameters names {len(out)} of the optimizer's parameters but not {unnamed} others")
    return out


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, Any]] | None = None, *,
                         backend: str = "ring", bucket_mb: float = 25, op: str = "mean", sync: bool = True,
                         backward_passes_per_step: int = 1, average_in_backward: bool = False) -> Any:
    """``optimizer`` distributed over the ranks of ``zmqflow.torch.init()``'s cluster.

    backend ``'ring'``: gradients averaged (``op='mean'``, or ``'sum'``) over the ring in buckets of
    about ``bucket_mb`` MB started from backward, then the wrapped optimizer steps (call
    :meth:`synchronize` first to read or clip the averages, as under Horovod). With
    ``average_in_backward=True`` backward itself returns with the averages, as DDP's does, so
    ``clip_grad_norm_`` or ``GradScaler.unscale_`` right after it act on them; every rank must then
    give every parameter a gradient each step (a rank that does not raises at ``step()``). A parameter
    without a gradient on a rank contributes zeros; one without a gradient on every rank keeps
    ``.grad`` None (the optimizer skips it, as alone). ``backward_passes_per_step``: backward passes
    accumulated locally (summed, as torch accumulates) before each average.

    backend ``'ps'``: parameters on the ps shards with the equivalent server-side optimizer
    (SGD/momentum, Adam, Adagrad; see :mod:`.ps_optimizer`), ``sync=True`` for SyncReplicas over
    every rank, ``False`` for asynchronous updates.

    ``named_parameters`` (``model.named_parameters()``) names the parameters in errors and, for the
    ps backend, in the shards' variables (``torch/<name>``); without it they are named by place.
    Every rank must build the same optimizer over the same parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgument(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, (RingOptimizerMixin, PsOptimizerMixin)):
        raise InvalidArgument("this optimizer is already a DistributedOptimizer")
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    rt = _runtime.current()
    named = _named(optimizer, named_parameters)
    if backend == "ring":
        if not sync:
            raise ConfigError("backend='ring' is synchronous: every step averages every rank's gradients (sync=False "
                              "is for backend='ps')")
        if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise InvalidArgument(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        obj = _subclass(optimizer, RingOptimizerMixin)
        obj.init_distributed(named, int(bucket_mb * (1 << 20)), op, backward_passes_per_step, rt.timeout,
                             bool(average_in_backward))
        return obj
    if op != "mean":
        raise ConfigError(f"backend='ps' averages gradients (SyncReplicas) or applies each on arrival; op={op!r} "
                          "is for backend='ring'")
    if backward_passes_per_step != 1:
        raise ConfigError("backend='ps' pushes every step's gradients: backward_passes_per_step must be 1")
    if average_in_backward:
        raise ConfigError("average_in_backward is for backend='ring'; backend='ps' pushes at step()")
    obj = _subclass(optimizer, PsOptimizerMixin)
    obj.init_distributed(named, rt, bool(sync), type(optimizer))
    return obj
