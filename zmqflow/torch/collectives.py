"""Horovod-shaped collectives on torch tensors, over the process-wide runtime's ring.

Every rank must make the same calls in the same order (from one thread: the calls of one thread
start in that order). A call whose tensors disagree across ranks (shape, dtype, op, root) raises
``CollectiveMismatch`` on every rank instead of hanging. CPU tensors are reduced in place as numpy
views, CUDA tensors on the GPU through cupy (see :mod:`.tensors`).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..bridge import runtime as _runtime
from ..client.ring_blocking import Ring
from ..errors import CollectiveMismatch, InvalidArgument
from ..state.reduce import OPS
from .tensors import from_array, to_array, write_into

__all__ = [
    "Average", "Sum", "Min", "Max", "Handle", "init", "shutdown", "is_initialized", "rank", "size", "local_rank",
    "local_size", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather", "broadcast",
    "broadcast_", "broadcast_object", "broadcast_parameters", "broadcast_optimizer_state", "barrier", "synchronize",
]

Average, Sum, Min, Max = "mean", "sum", "min", "max"
_WAIT_MARGIN = 5.0  # beyond the ring's own deadline, so its error (naming the late rank) arrives first


def init(cluster: Any = None, task: Any = None, *, timeout: float = 60.0) -> _runtime.Runtime:
    """Join the cluster ``zmqflow launch`` describes in the environment (or ``cluster``/``task``);
    alone, a private one-rank cluster. Once per process: later calls return the same runtime."""
    return _runtime.init(cluster, task, timeout=timeout)


def shutdown() -> None:
    """Leave the cluster; ``init`` may follow. The runtime tells the other ranks this one is done
    before its server stops, so a rank finishing the last collective does not take this one's
    exit for a death. Async collectives not synchronized are dropped."""
    with _lock:
        _pending.clear()
    _runtime.shutdown()


def is_initialized() -> bool:
    return _runtime.is_initialized()


def rank() -> int:
    return _runtime.current().rank


def size() -> int:
    return _runtime.current().size


def local_rank() -> int:
    return _runtime.current().local_rank


def local_size() -> int:
    return _runtime.current().local_size


def ring() -> Ring:
    """This process's ring (a ``ConfigError`` on a task that is no rank, such as a ps task)."""
    return _runtime.current().require_ring()


def _check_op(op: str) -> str:
    if op not in OPS:
        raise InvalidArgument(f"op must be one of {', '.join(OPS)}, got {op!r}")
    return op


# allreduce -------------------------------------------------------------------------------------


def allreduce(tensor: torch.Tensor, op: str = Average) -> torch.Tensor:
    """A new tensor: ``op`` (mean by default) of ``tensor`` over every rank, same shape, dtype and device.
    Integer means truncate toward zero. A mean or sum of a tensor that requires grad is differentiable,
    as Horovod's: its backward is the same collective of the gradient, on every rank."""
    _check_op(op)
    if tensor.requires_grad and op in (Average, Sum):
        return _Allreduce.apply(tensor, op)
    return _allreduce(tensor, op)


def _allreduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    src = tensor.detach().contiguous()
    out = ring().allreduce(to_array(src, "allreduce"), op)
    return from_array(out, tensor).view(tensor.shape)


class _Allreduce(torch.autograd.Function):
    """y = op(x over ranks): each rank's x gets the same op of every rank's dL/dy."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: str) -> torch.Tensor:  # type: ignore[override]
        ctx.op = op
        return _allreduce(tensor, op)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _allreduce(grad, ctx.op), None


def allreduce_(tensor: torch.Tensor, op: str = Average) -> torch.Tensor:
    """:func:`allreduce` into ``tensor`` itself; returns it (an in-place write: not differentiable)."""
    return write_into(tensor, _allreduce(tensor, _check_op(op)))


class Handle:
    """An async collective in flight; :func:`synchronize` (or :meth:`wait`) gives its result."""

    def __init__(self, future: Any, finish: Any, keep: Any):
        self._future = future
        self._finish = finish
        self._keep = keep  # the input stays alive until the ring has read it
        self._result: Any = None
        self._done = False

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            limit = (_runtime.current().timeout if timeout is None else timeout) + _WAIT_MARGIN
            self._result = self._finish(self._future.result(limit))
            self._done, self._keep = True, None
            with _lock:
                if self in _pending:
                    _pending.remove(self)
        return self._result


_lock = threading.Lock()
_pending: list[Handle] = []


def _start(coro: Any, finish: Any, keep: Any) -> Handle:
    handle = Handle(ring().submit(coro), finish, keep)
    with _lock:
        _pending.append(handle)
    return handle


def allreduce_async(tensor: torch.Tensor, op: str = Average) -> Handle:
    """Start :func:`allreduce` without waiting; ``synchronize(handle)`` returns the new tensor.
    Leave ``tensor`` unchanged until then."""
    _check_op(op)
    src = tensor.detach().contiguous()
    r = ring()
    return _start(r.async_ring.allreduce(to_array(src, "allreduce"), op),
                  lambda out: from_array(out, tensor).view(tensor.shape), src)


def allreduce_async_(tensor: torch.Tensor, op: str = Average) -> Handle:
    """Start :func:`allreduce_` without waiting; ``synchronize(handle)`` writes and returns ``tensor``."""
    _check_op(op)
    src = tensor.detach().contiguous()
    r = ring()
    return _start(r.async_ring.allreduce(to_array(src, "allreduce"), op), lambda out: write_into(tensor, out), src)


def synchronize(handle: Handle | None = None) -> Any:
    """With ``handle``: wait for that async collective and return its result. Without: wait for
    every async collective this process started, then for every rank to get here (a barrier, so
    it is itself a collective: every rank must call it)."""
    if handle is not None:
        return handle.wait()
    with _lock:
        pending = list(_pending)
    for h in pending:
        h.wait()
    barrier()
    return None


def barrier() -> None:
    """Return once every rank has called ``barrier``."""
    ring().barrier()


# allgather and broadcast -----------------------------------------------------------------------


def allgather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order, as Horovod does: the first
    dimension may differ between ranks, the others and the dtype may not (``CollectiveMismatch``
    on every rank). A 0-d tensor counts as shape ``(1,)``. Differentiable for a tensor that requires
    grad: each rank's rows get the sum over ranks of the gradient at them."""
    if tensor.requires_grad:
        return _Allgather.apply(tensor)
    return _allgather(tensor)[0]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, rows = _allgather(tensor)
        me = ring().rank
        ctx.shape, ctx.start, ctx.rows = tensor.shape, sum(rows[:me]), rows[me]
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        summed = _allreduce(grad, Sum)
        return summed[ctx.start: ctx.start + ctx.rows].reshape(ctx.shape)


def _allgather(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The concatenation, and each rank's rows in it."""
    r = ring()
    src = tensor.detach().contiguous()
    if src.dim() == 0:
        src = src.reshape(1)
    shapes = r.allgather(np.array(src.shape, np.int64))  # ranks with another ndim fail here, on every rank
    if (shapes[:, 1:] != shapes[0, 1:]).any():
        raise CollectiveMismatch(
            "allgather: tensors must agree beyond dim 0; shapes by rank: "
            + ", ".join(f"{i}: {list(map(int, s))}" for i, s in enumerate(shapes)), fields=["shapes"])
    rows = [int(n) for n in shapes[:, 0]]
    longest = max(rows)
    if all(n == longest for n in rows):
        out = r.allgather(to_array(src, "allgather"))
        return from_array(out, tensor).reshape(sum(rows), *src.shape[1:]), rows
    padded = src.new_zeros((longest, *src.shape[1:]))
    padded[:rows[r.rank]] = src
    out = from_array(r.allgather(to_array(padded, "allgather")), tensor)
    return torch.cat([out[i, :n] for i, n in enumerate(rows)]), rows


def broadcast(tensor: torch.Tensor, root_rank: int) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor`` (every rank passes one of the same shape and
    dtype). Differentiable for a tensor that requires grad: the root's gets the sum over ranks of
    the gradient, the others' zeros."""
    if tensor.requires_grad:
        return _Broadcast.apply(tensor, int(root_rank))
    return _broadcast(tensor, root_rank)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int) -> torch.Tensor:  # type: ignore[override]
        ctx.root = root_rank
        return _broadcast(tensor, root_rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        summed = _allreduce(grad, Sum)
        return (summed if ring().rank == ctx.root else torch.zeros_like(summed)), None


def _broadcast(tensor: torch.Tensor, root_rank: int) -> torch.Tensor:
    src = tensor.detach().contiguous()
    out = ring().broadcast(to_array(src, "broadcast"), int(root_rank))
    return from_array(out, tensor).view(tensor.shape)


def broadcast_(tensor: torch.Tensor, root_rank: int) -> torch.Tensor:
    """:func:`broadcast` into ``tensor`` itself; returns it (an in-place write: not differentiable)."""
    return write_into(tensor, _broadcast(tensor, root_rank))


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s ``obj`` on every rank (others pass anything, e.g. None). It travels as
    ``torch.save`` bytes and is read with ``weights_only=True``: tensors, numbers, strings, and
    lists, tuples and dicts of them (what optimizer and module state dicts hold)."""
    r = ring()
    me = r.rank == int(root_rank)
    payload = np.zeros(0, np.uint8)
    if me:
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = np.frombuffer(buf.getbuffer(), np.uint8).copy()
    length = r.broadcast(np.array([payload.size], np.int64), int(root_rank))
    data = r.broadcast(payload if me else np.zeros(int(length[0]), np.uint8), int(root_rank))
    if me:
        return obj
    return torch.load(io.BytesIO(data.tobytes()), map_location="cpu", weights_only=True)


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        params = params.state_dict()
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))  # the same order on every rank
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (str(i), p) for i, p in enumerate(params)]
    else:
        raise InvalidArgument(f"broadcast_parameters takes a state dict, a module or (name, tensor) pairs, "
                              f"got {type(params).__name__}")
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"broadcast_parameters: {name!r} is a {type(t).__name__}, not a tensor")
    return [(str(n), t) for n, t in items]


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Overwrite every tensor of ``params`` (a ``state_dict()``, ``named_parameters()``, or a
    module) in place with ``root_rank``'s values. Tensors are fused per dtype and device, so a
    model moves as a few big broadcasts."""
    items = _named_tensors(params)
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for _, t in items:
        groups.setdefault((t.dtype, t.device), []).append(t)
    r = ring()
    for (dtype, device), tensors in groups.items():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.zeros(0, dtype=dtype)
        out = r.broadcast(to_array(flat, f"broadcast_parameters ({dtype})"), int(root_rank))
        if r.rank == int(root_rank):
            continue
        values = from_array(out, flat)
        start = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(values[start:start + t.numel()].view(t.shape))
                start += t.numel()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state in place: its per-parameter state (moments,
    step counts) and every param group's hyperparameters. A rank whose optimizer has no state
    yet gets root's; nothing is stepped to make it (no zero-gradient step moves a parameter)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidArgument(f"broadcast_optimizer_state takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    mine = ring().rank == int(root_rank)
    state = broadcast_object(optimizer.state_dict() if mine else None, root_rank)
    if not mine:
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError) as exc:
            raise InvalidArgument(f"broadcast_optimizer_state: rank {root_rank}'s optimizer state does not fit "
                                  f"this rank's optimizer: {exc}") from exc
