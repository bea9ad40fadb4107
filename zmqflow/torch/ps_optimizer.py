"""The ps backend of ``DistributedOptimizer``: dense parameters on ps shards, updated there.

Each parameter is a variable on the ps shards whose server-side optimizer is the torch optimizer's
equivalent with the same hyperparameters (``SGD`` with or without momentum, ``Adam``, ``Adagrad``);
anything else, or an option the shards do not implement, is a ``ConfigError`` naming it. Each
push carries its group's learning rate, so an LR scheduler reaches the shards at every step (the
other hyperparameters are the variables' own: one that changes is a ``ConfigError``). Rank 0
creates the variables from its parameters' values (a variable that already exists is attached, not
overwritten); every rank then loads the shards' values into its parameters. ``step()`` pushes the
gradients (sync: SyncReplicas over every rank, one update per round of gradients, averaged; async:
applied on arrival) and pulls the new values into ``param.data`` in place, so the module is fresh
for the next forward. The torch optimizer's own state stays empty: the slots live on the shards.

Differences from torch, by construction of the shards' optimizers: Adam adds ``eps`` to
``sqrt(v)`` before the bias correction (TF's form), so its ``eps`` acts as torch's
``eps / sqrt(1 - beta2**t)``: 32x larger at the first step with the default betas, the same after
some thousands of steps. A gradient within ~100x of that moves its parameter a few percent of a
step less than torch would in the first steps; elsewhere the two agree to float rounding.
Adagrad's ``eps`` becomes a floor of ``eps**2`` on the accumulator (``g / sqrt(acc + eps**2)``
for torch's ``g / (sqrt(acc) + eps)``).
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import torch

from ..bridge.runtime import Runtime
from ..errors import ConfigError, InvalidArgument, VariableConflict
from ..observe.progress import counts_steps
from ..state import optim as _optim
from .tensors import to_array, write_into
from .wrapped import SharesState

__all__ = ["server_optimizer", "PsOptimizerMixin", "VARIABLE_PREFIX", "refuse_unplanned"]

VARIABLE_PREFIX = "torch/"

# which live optimizer of this process holds each variable of a session: two models whose
# parameters share names (two Sequentials both have "0.weight") must not silently share variables
_holders: "weakref.WeakKeyDictionary[Any, weakref.WeakValueDictionary[str, Any]]" = weakref.WeakKeyDictionary()
_holders_lock = threading.Lock()


def _hold(session: Any, names: list[str], optimizer: Any) -> None:
    """Claim ``names`` for ``optimizer``, or VariableConflict when another live one holds any (one
    only unreachable, waiting for the garbage collector, holds nothing)."""
    with _holders_lock:
        held = _holders.setdefault(session, weakref.WeakValueDictionary())
        taken = [n for n in names if held.get(n) not in (None, optimizer)]
        if taken:
            gc.collect()
            taken = [n for n in taken if held.get(n) not in (None, optimizer)]
        if taken:
            raise VariableConflict(
                f"backend='ps': variable {taken[0]!r} already holds a parameter of another DistributedOptimizer in "
                "this process (two models with the same parameter names?); give each model's names a prefix: "
                "named_parameters=[(f'gen.{n}', p) for n, p in gen.named_parameters()]")
        for name in names:
            held[name] = optimizer


def _refuse(kind: type, group: dict[str, Any], defaults: dict[str, Any]) -> None:
    for key, default in defaults.items():
        value = group.get(key, default)
        if value != default and value is not None:
            raise ConfigError(f"backend='ps': {kind.__name__}({key}={value!r}) is not supported by the ps shards' "
                              f"optimizer (only {key}={default!r}); use backend='ring'")


def server_optimizer(kind: type, group: dict[str, Any]) -> _optim.Optimizer:
    """The shards' optimizer equivalent to the torch optimizer class ``kind`` with ``group``'s hyperparameters."""
    lr = float(group["lr"])
    if kind is torch.optim.SGD:
        _refuse(kind, group, {"dampening": 0, "weight_decay": 0, "maximize": False})
        momentum = float(group.get("momentum", 0.0))
        if momentum == 0.0:
            return _optim.SGD(learning_rate=lr)
        return _optim.Momentum(learning_rate=lr, momentum=momentum, nesterov=bool(group.get("nesterov", False)))
    if kind is torch.optim.Adam:
        _refuse(kind, group, {"weight_decay": 0, "amsgrad": False, "maximize": False})
        beta1, beta2 = (float(b) for b in group["betas"])
        return _optim.Adam(learning_rate=lr, beta1=beta1, beta2=beta2, epsilon=float(group["eps"]))
    if kind is torch.optim.Adagrad:
        _refuse(kind, group, {"lr_decay": 0, "weight_decay": 0, "maximize": False})
        floor = float(group.get("eps", 1e-10)) ** 2  # the shards divide by sqrt(acc): no zero accumulator
        return _optim.Adagrad(learning_rate=lr, initial_accumulator_value=max(float(group["initial_accumulator_value"]), floor))
    raise ConfigError(f"backend='ps' runs the optimizer on the ps shards, which have SGD (with momentum), Adam and "
                      f"Adagrad; {kind.__module__}.{kind.__qualname__} is not supported: use backend='ring'")


# what the shards' optimizer keeps of a group: every hyperparameter but the learning rate, which each push carries
_HYPER = ("momentum", "nesterov", "betas", "eps", "initial_accumulator_value")


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters the shards keep, comparable (a tensor as its numbers)."""
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k in _HYPER}


def refuse_unplanned(optimizer: Any, planned: frozenset[int]) -> None:
    """InvalidArgument when a parameter of ``optimizer``'s groups has a gradient but is not one the
    distributed optimizer was made for (frozen then, unfrozen since; or a group added later): its
    gradient would be neither averaged nor stepped, and the ranks would part ways in silence."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and id(p) not in planned:
                raise InvalidArgument(
                    f"a parameter of shape {list(p.shape)} has a gradient but was not trainable when "
                    "DistributedOptimizer was made (unfrozen since, or added with add_param_group): make the "
                    "DistributedOptimizer again over the parameters to train")


class PsOptimizerMixin(SharesState):
    """Methods of the torch optimizer subclass for ``backend='ps'`` (see the module docstring)."""

    def init_distributed(self, named: list[tuple[str, torch.Tensor]], runtime: Runtime, sync: bool, kind: type) -> None:
        """Create (rank 0) or find the variables, then load their values into the parameters.
        ``kind``: the wrapped torch optimizer's class."""
        self._zf_runtime = runtime
        self._zf_named = named
        self._zf_names = [VARIABLE_PREFIX + n for n, _ in named]
        self._zf_planned = frozenset(id(p) for _, p in named)
        _hold(runtime.session, self._zf_names, self)
        groups = {id(p): g for g in self.param_groups for p in g["params"]}  # type: ignore[attr-defined]
        self._zf_hyper = [_hyper(g) for g in self.param_groups]  # type: ignore[attr-defined]
        sess = runtime.session
        if runtime.rank == 0:
            size = runtime.size
            for (name, p), var in zip(named, self._zf_names):
                opt: Any = server_optimizer(kind, groups[id(p)])
                if sync:
                    opt = _optim.SyncReplicas(opt, replicas_to_aggregate=size, total_num_replicas=size)
                sess.variable(var, to_array(p.detach().cpu().contiguous(), f"parameter {name!r}").copy(), optimizer=opt)
        else:
            for (_, p) in named:
                server_optimizer(kind, groups[id(p)])  # refuse here too, not only on rank 0
        for var in self._zf_names:
            sess.get(var, timeout=runtime.timeout)  # waits for rank 0 to create it
        self._zf_pull()
        if sync:
            sess.global_step()  # pushes carry the shards' step

    def _zf_pull(self, grads: dict[str, Any] | None = None, rate: float | None = None) -> None:
        """The shards' values into the parameters; with ``grads``, those variables' only, after
        pushing them at ``rate`` in the same call (``Session.push_pull``: the pull of each group
        beside the push of the next, or a small model's rows in the pushes' answers). A contiguous
        CPU parameter is the pull's ``out=`` (a numpy view of its memory), filled slice by slice
        as the replies land: no received frames to fault in and copy afterwards. Others (CUDA,
        strided) are copied in from the received arrays. A pull that fails part way may have
        written some slices already: each is a value the shards held."""
        named = [(name, p, var) for (name, p), var in zip(self._zf_named, self._zf_names)
                 if grads is None or var in grads]
        into = {var: to_array(p.data, f"parameter {name!r}") for name, p, var in named
                if p.data.device.type == "cpu" and p.data.is_contiguous()}
        sess = self._zf_runtime.session
        values = (sess.pull([var for _, _, var in named], out=into) if grads is None
                  else sess.push_pull(grads, learning_rate=rate, out=into))
        for _, p, var in named:
            if var not in into:
                write_into(p.data, values[var])

    def synchronize(self) -> None:
        """Nothing to wait for: ``step()`` pushes and pulls synchronously."""

    @counts_steps
    def step(self, closure: Any = None) -> Any:
        """Push this rank's gradients and load the shards' new values into the parameters, the two
        overlapped (``Session.push_pull``). A parameter without a gradient is pushed as absent: in
        a sync round it counts as a zero gradient beside the ranks that have one (as DDP averages),
        and when no rank has one the shards leave it and its optimizer slots alone, as torch's
        optimizers skip it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        refuse_unplanned(self, self._zf_planned)
        now = [_hyper(g) for g in self.param_groups]  # type: ignore[attr-defined]
        if now != self._zf_hyper:
            changed = sorted({k for a, b in zip(now, self._zf_hyper) for k in a if a.get(k) != b.get(k)})
            raise ConfigError(f"backend='ps': the optimizer's {', '.join(changed) or 'parameter groups'} changed after "
                              "DistributedOptimizer was made; the ps shards keep the ones they were created with (a "
                              "learning rate may change: each push carries it)")
        rates = {id(p): float(g["lr"]) for g in self.param_groups for p in g["params"]}  # type: ignore[attr-defined]
        by_rate: dict[float, dict[str, Any]] = {}
        for (name, p), var in zip(self._zf_named, self._zf_names):
            g = p.grad
            by_rate.setdefault(rates[id(p)], {})[var] = (
                None if g is None else to_array(g.detach().cpu().contiguous(), f"gradient of {name!r}"))
        for rate, grads in by_rate.items():  # one push a learning rate (most models have one), each with its pull
            self._zf_pull(grads, rate)
        return loss


PsOptimizerMixin.step.hooked = True  # type: ignore[attr-defined]  # torch must not wrap it again
