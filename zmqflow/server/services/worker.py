"""The worker service: remote functions on an allow-list, and diagnostics that move tensors.

``run`` imports a function by its path (``package.module:function``) and calls it with msgpack
arguments. Only modules on the task's allow-list (``--allow-module``, ``ZMQFLOW_ALLOW_MODULES``)
and their submodules may run: a remote caller can never name arbitrary code, and nothing is
unpickled.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any

import numpy as np

from ...errors import InvalidArgument, NotFound
from ...rpc import CallContext, Service, op
from ...wire.requests import OPEN
from ...wire.requests import cluster as rq

__all__ = ["WorkerService"]


class WorkerService(Service):
    name = "worker"

    def __init__(self, allow_modules: list[str] | None = None):
        super().__init__()
        self.allow_modules = tuple(m.strip() for m in (allow_modules or []) if m.strip())

    @op(OPEN)
    def echo(self, ctx: CallContext, **values: Any) -> dict[str, Any]:
        """Return the arguments as received; arrays go back zero-copy from the received frames."""
        return values

    @op(OPEN)
    def sink(self, ctx: CallContext, **values: Any) -> int:
        """Swallow the arguments and answer with the number of tensor bytes received."""
        return sum(v.nbytes for v in values.values() if isinstance(v, np.ndarray))

    def allowed(self, module: str) -> bool:
        return any(module == m or module.startswith(m + ".") for m in self.allow_modules)

    @op(rq.Run)
    async def run(self, ctx: CallContext, req: rq.Run) -> Any:
        """Call ``package.module:function(*args, **kwargs)``; coroutines are awaited, plain
        functions run on a thread so the task keeps serving."""
        function, args, kwargs = req.function, req.args, req.kwargs
        module_name, sep, attr = function.partition(":")
        if not sep or not module_name or not attr:
            raise InvalidArgument(f"function must look like 'package.module:function', got {function!r}")
        if not self.allowed(module_name):
            allowed = ", ".join(self.allow_modules) or "nothing (start the task with --allow-module)"
            raise InvalidArgument(f"module {module_name!r} is not on this task's allow-list; allowed: {allowed}")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise NotFound(f"cannot import {module_name!r}: {exc}") from None
        fn = module
        for part in attr.split("."):
            fn = getattr(fn, part, None)
            if fn is None:
                raise NotFound(f"{module_name!r} has no {attr!r}")
        if not callable(fn):
            raise InvalidArgument(f"{function!r} is not callable")
        if inspect.iscoroutinefunction(fn):
            return await fn(*(args or []), **(kwargs or {}))
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*(args or []), **(kwargs or {})))
