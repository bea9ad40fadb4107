"""Gradient buckets whose ring allreduces start during backward, as DDP's reducer does.

Parameters are cut into buckets of about ``bucket_bytes`` in reverse registration order (the
order backward produces their gradients), one dtype and device per bucket. A per-parameter
``register_post_accumulate_grad_hook`` marks a gradient ready; once every gradient of bucket k
is ready, and every bucket before k has started, bucket k's allreduce starts on the ring's loop
(``Ring.submit``) while backward goes on. Bucket k never starts before bucket k-1, so every rank
starts the same calls in the same order whatever order its hooks fired in.

Each bucket is one fused flat array (the ring fuses the gradients and one flag per parameter into
a single buffer, so one bucket is one ring call with one sequence number, and several buckets may
be in flight at once). A flag says whether this rank had a gradient for the parameter: a parameter
without one contributes zeros, and a parameter that no rank had a gradient for keeps ``.grad``
None after the average, so the optimizer skips it exactly as it would in one process. Buckets
left unstarted when backward ends (their parameters were unused) start at :meth:`synchronize`,
in order, so no rank waits for a call another rank never makes. (So where a parameter may go
unused on some ranks only, call ``synchronize()`` before any other collective between backward and
step: until then the ranks may have started different numbers of buckets.)

With ``in_backward`` (``DistributedOptimizer(average_in_backward=True)``), the hook that starts
the last bucket waits for every bucket and sets the averaged gradients before backward returns, as
DDP's backward does: code that reads or changes gradients between ``backward()`` and ``step()``
(``clip_grad_norm_``, ``GradScaler.unscale_``) sees the average, and never races the ring, which
reads CPU gradients in place. Only the last bucket's wait moves into backward: the earlier ones
still overlap it. As under DDP without ``find_unused_parameters``, every rank must then give every
parameter a gradient in each step: a rank that leaves one unused would clip its own gradients
where the others clip the average, so its ``step()`` starts the remaining buckets (the others
are waiting for them) and then raises ``InvalidArgument`` naming the parameters, never stepping
apart in silence. Off (the default, as Horovod), call ``synchronize()`` before touching gradients.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..client.ring_blocking import Ring
from ..errors import InvalidArgument
from .tensors import check_dtype, cuda_ready, from_array, to_array

__all__ = ["Bucket", "GradientBuckets", "plan_buckets"]

_WAIT_MARGIN = 5.0


@dataclass(eq=False)
class Bucket:
    """Parameters reduced together, in the order their gradients are laid out in the fused buffer."""

    index: int
    names: list[str]
    params: list[torch.Tensor]
    nbytes: int = 0
    waiting: int = 0  # gradients not yet ready this step
    future: Any = None  # the in-flight allreduce
    keep: Any = field(default=None, repr=False)  # what the ring reads until it has fused it


def plan_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Buckets over ``named`` (registration order) taken in reverse, of at most ``bucket_bytes``
    each (a bigger parameter gets a bucket of its own), never mixing dtypes or devices."""
    out: list[Bucket] = []
    key = None
    for name, p in reversed(named):
        k = (p.dtype, p.device)
        size = p.numel() * p.element_size()
        if not out or k != key or (out[-1].params and out[-1].nbytes + size > bucket_bytes):
            out.append(Bucket(len(out), [], []))
            key = k
        out[-1].names.append(name)
        out[-1].params.append(p)
        out[-1].nbytes += size
    return out


# which live buckets average each parameter: a second set over the same parameters would average
# their gradients twice, and a dropped optimizer's hooks must not go on starting allreduces
# by id (a tensor compares elementwise, so it cannot key a WeakKeyDictionary), with a weak
# reference to the parameter that tells a reused id apart
_owners: "dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[GradientBuckets]]]" = {}


def _ready(owner: "weakref.ref[GradientBuckets]", p: torch.Tensor) -> None:
    """A hook that holds its buckets weakly: once they are dropped, it does nothing."""
    buckets = owner()
    if buckets is not None:
        buckets.grad_ready(p)


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()


def _owned(named: list[tuple[str, torch.Tensor]], mine: Any) -> str | None:
    """The name of a parameter another live set of buckets averages, if any."""
    for name, p in named:
        param, owner = _owners.get(id(p), (None, None))
        other = owner() if owner is not None and param is not None and param() is p else None
        if other is not None and other is not mine and other.hooked:
            return name
    return None


class GradientBuckets:
    """The bucketed, overlapped gradient allreduce of one set of parameters on one ring.

    ``passes``: backward passes accumulated locally (in ``.grad``) before a parameter's gradient
    counts as ready; a gradient accumulated more often than that before :meth:`synchronize`
    raises ``InvalidArgument`` out of ``backward``."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], ring: Ring, *, bucket_bytes: int, op: str = "mean",
                 passes: int = 1, timeout: float = 60.0, in_backward: bool = False):
        if op not in ("mean", "sum"):
            raise InvalidArgument(f"gradients are averaged ('mean') or summed ('sum'), not {op!r}")
        if not isinstance(passes, int) or passes < 1:
            raise InvalidArgument(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        if bucket_bytes < 1:
            raise InvalidArgument(f"bucket size must be positive, got {bucket_bytes} bytes")
        for name, p in named:
            check_dtype(p, f"parameter {name!r}")
        self.ring = ring
        self.op = op
        self.passes = passes
        self.timeout = timeout
        self.buckets = plan_buckets(named, bucket_bytes)
        self.start_order: list[int] = []  # bucket indices in the order this step started them
        self._where: dict[int, Bucket] = {id(p): b for b in self.buckets for p in b.params}
        self._counts: dict[int, int] = {}
        self._next = 0
        self.in_backward = bool(in_backward)
        self.averaged = False  # this step's gradients were averaged by backward itself
        self.wait_s = 0.0  # seconds backward spent waiting for the last buckets, over every step
        self._averages: dict[int, Any] = {}  # the .grad tensors backward left averaged, by parameter
        self._lock = threading.RLock()
        self._reset()
        if _owned(named, self) is not None:
            gc.collect()  # an optimizer dropped but not yet collected averages nothing
        taken = _owned(named, self)
        if taken is not None:
            raise InvalidArgument(f"parameter {taken!r} is already averaged by another live DistributedOptimizer; "
                                  "drop it, or call its remove_hooks(), before making another over the same parameters")
        hook = functools.partial(_ready, weakref.ref(self))
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for b in self.buckets for p in b.params]
        weakref.finalize(self, _remove, list(self._hooks))
        for key in [k for k, (param, owner) in _owners.items() if param() is None or owner() is None]:
            del _owners[key]  # parameters or buckets gone since
        for _, p in named:
            _owners[id(p)] = (weakref.ref(p), weakref.ref(self))

    @property
    def hooked(self) -> bool:
        """Whether the hooks are on the parameters (until :meth:`remove_hooks`)."""
        return bool(self._hooks)

    @property
    def in_flight(self) -> bool:
        """Whether a step's allreduces have started and not been collected by :meth:`synchronize`."""
        return self._next > 0 or any(self._counts.values())

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def grad_ready(self, p: torch.Tensor) -> None:
        """The hook: ``p``'s gradient was accumulated; start what became startable, in order."""
        with self._lock:
            if self.averaged and p.grad is not self._averages.get(id(p)):
                self._taken()  # the average was dropped (zero_grad, or grad = None): this starts a step
            bucket = self._where[id(p)]
            n = self._counts.get(id(p), 0) + 1 + (self.passes if self.averaged else 0)
            if n > self.passes:
                name = bucket.names[next(i for i, q in enumerate(bucket.params) if q is p)]
                raise InvalidArgument(
                    f"the gradient of {name!r} was computed {n} times before step() (backward_passes_per_step="
                    f"{self.passes}): call step() or synchronize() after each backward, or raise backward_passes_per_step")
            self._counts[id(p)] = n
            if n == self.passes:
                bucket.waiting -= 1
                self._launch_ready()
            last = self.in_backward and self._next == len(self.buckets)
        if last:  # every bucket started during this backward: it returns with the average, as DDP's
            began = time.perf_counter()
            self.synchronize()
            with self._lock:  # until step() or zero_grad() takes it: another gradient before is refused
                self.averaged = True
                self._averages = {id(q): q.grad for b in self.buckets for q in b.params}
            self.wait_s += time.perf_counter() - began

    def _taken(self) -> None:
        self.averaged = False
        self._averages = {}

    def take_average(self) -> None:
        """The gradients backward averaged are used or dropped (``step()``, ``zero_grad()``): the
        next backward starts a step."""
        with self._lock:
            self._taken()

    def synchronize(self) -> None:
        """Start every bucket not yet started (in order), wait for all, and leave each averaged
        gradient in its parameter's ``.grad``; nothing more where backward already did."""
        with self._lock:
            if self.averaged:
                self._taken()  # the next call (a second step without backward) averages again
                return
            # in_backward, but a backward here left parameters without their gradient
            unused = self._unused() if self.in_backward and self._counts else []
            for b in self.buckets:
                b.waiting = 0
            self._launch_ready()
            buckets = list(self.buckets)
        try:
            limit = self.timeout + _WAIT_MARGIN
            for b in buckets:
                self._finish(b, b.future.result(limit))
        finally:
            with self._lock:
                self._reset()
        if unused:
            shown = ", ".join(repr(n) for n in unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise InvalidArgument(
                f"average_in_backward: {shown} got no gradient in this step on this rank, so its backward could "
                "not average as the other ranks' did (they may have clipped or unscaled the average where this "
                "rank had its own gradients); use every parameter on every rank, or leave average_in_backward off "
                "and call synchronize() before touching gradients")

    def _unused(self) -> list[str]:
        """Names of the parameters whose gradients did not come ``passes`` times (under the lock)."""
        return [name for b in self.buckets for name, q in zip(b.names, b.params)
                if self._counts.get(id(q), 0) < self.passes]

    # machinery -------------------------------------------------------------------------------
    def _reset(self) -> None:
        for b in self.buckets:
            b.waiting, b.future, b.keep = len(b.params), None, None
        self._counts.clear()
        self._next = 0

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].waiting <= 0:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, b: Bucket) -> None:
        """Hand the bucket's gradients (and flags) to the ring as one fused call. On a GPU they are
        fused there first (one pass at device bandwidth), so the ring stages one array through the
        host, not one per parameter: each array costs a DLPack export, a stream sync and a copy."""
        template = b.params[0]
        grads = []
        for name, p in zip(b.names, b.params):
            g = p.grad
            if g is None:
                g = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif g.layout != torch.strided:
                raise InvalidArgument(f"the gradient of {name!r} is sparse: the ring reduces dense gradients only")
            grads.append(g.detach().reshape(-1))
        # one small copy of the flags, where setting them one by one would launch a kernel each on a GPU
        flags = torch.tensor([p.grad is not None for p in b.params], dtype=template.dtype, device=template.device)
        parts = [*grads, flags]
        if template.is_cuda or b.nbytes + flags.nbytes > self.ring.async_ring.bucket_bytes:
            parts = [torch.cat(parts)]  # on the CPU: only when the ring would cut a list this big into calls of its own
        arrays = [to_array(t.contiguous(), f"gradient bucket {b.index}") for t in parts]
        cuda_ready(template)
        b.keep = arrays
        b.future = self.ring.submit(self.ring.async_ring.allreduce(arrays, self.op))
        if self._next == 0:
            self.start_order.clear()
        self.start_order.append(b.index)

    def _finish(self, b: Bucket, out: list[Any]) -> None:
        # the fused result as one tensor, cut by torch: one DLPack import, not one per parameter
        fused = from_array(out[0], b.params[0]) if len(out) == 1 else None
        start = 0
        flags = (from_array(out[-1]) if fused is None else fused[-len(b.params):]).cpu().tolist()
        with torch.no_grad():
            for i, p in enumerate(b.params):
                n = p.numel()
                part = out[i] if fused is None else fused[start:start + n]
                start += n
                if not flags[i]:
                    p.grad = None  # no rank had a gradient: the optimizer skips it, as alone
                    continue
                value = part if fused is not None else from_array(part, p)
                value = value.view(p.shape)  # the ring's result buffer, its own for this call
                if p.grad is None or p.grad.layout != torch.strided or p.grad.dtype != p.dtype:
                    # in the parameter's own strides (channels_last, say), as autograd lays gradients out
                    p.grad = value if p.is_contiguous() else torch.empty_like(p).copy_(value)
                elif p.grad.is_contiguous():
                    p.grad.set_(value)  # as Horovod does: the same .grad tensor, now on the averaged values, no copy
                else:  # kept in its strides: fused optimizers read a gradient's memory as the parameter's
                    p.grad.copy_(value)
