"""The worker service: remote functions that cannot escape, and diagnostics that move tensors.

``run`` calls one of two kinds of function, and nothing else:

- a function the task registered by name (``server.register_function("train_step", fn)``);
- ``package.module:function``, a top-level public function *defined in* a module on the task's
  allow-list (``--allow-module``, ``ZMQFLOW_ALLOW_MODULES``) or in a submodule of one.

A caller names a function, never a path through objects: no dots after the colon, no names
starting with ``_``, nothing a module merely imported (``json:codecs``), no classes or builtins.
The string is checked first, then the allow-list, and only then is the module imported, so a
refused name runs no code at all. Every refusal is ``PermissionDenied`` naming the function.
Arguments and results are msgpack values and tensor frames; nothing is unpickled.

A plain function runs on a thread of its own, which nothing can stop: when the call's deadline
cancels it, the RPC server stops counting it in flight, but the thread runs on. So the threads
are counted here until each ends, and a call past ``max_threads`` is refused (``ResourceExhausted``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import keyword
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ...errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from ...rpc import CallContext, Service, op
from ...wire.requests import OPEN
from ...wire.requests import cluster as rq

__all__ = ["WorkerService", "MAX_RUN_THREADS"]

MAX_RUN_THREADS = 128  # plain functions a task runs at once (ServerLimits.max_run_threads)

_HINT = ("a task runs only functions it registered (server.register_function) or public functions defined in "
         "a module on its allow-list (--allow-module)")


def _public(name: str) -> bool:
    return name.isidentifier() and not name.startswith("_") and not keyword.iskeyword(name)


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class WorkerService(Service):
    name = "worker"

    def __init__(self, allow_modules: list[str] | None = None, max_threads: int = MAX_RUN_THREADS):
        super().__init__()
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise InvalidArgument(f"max_threads must be a positive integer, got {max_threads!r}")
        self.allow_modules = tuple(m.strip() for m in (allow_modules or []) if m.strip())
        self.functions: dict[str, Callable[..., Any]] = {}
        self.max_threads = max_threads
        self._running = 0  # threads started and not yet ended (under _count: they end on their own)
        self._count = threading.Lock()

    @property
    def running(self) -> int:
        """Plain functions whose threads have not ended, cancelled calls included."""
        with self._count:
            return self._running

    def register(self, name: str, fn: Callable[..., Any]) -> None:
        """Let sessions call ``fn`` as ``sess.run(name, task=...)``; a name registered again is replaced."""
        if not isinstance(name, str) or not name or ":" in name or len(name) > 1024 or not name.isprintable():
            raise InvalidArgument(f"a registered function's name must be 1..1024 printable characters without "
                                  f"':' (that form names a module's function), got {name!r}")
        if not callable(fn):
            raise InvalidArgument(f"register_function({name!r}, ...) needs a callable, got {type(fn).__name__}")
        self.functions[name] = fn

    @op(OPEN)
    def echo(self, ctx: CallContext, **values: Any) -> dict[str, Any]:
        """Return the arguments as received; arrays go back zero-copy from the received frames."""
        return values

    @op(OPEN)
    def sink(self, ctx: CallContext, **values: Any) -> int:
        """Swallow the arguments and answer with the number of tensor bytes received."""
        return sum(v.nbytes for v in values.values() if isinstance(v, np.ndarray))

    def allowed(self, module: str) -> bool:
        """On the allow-list: an allowed module, or a public submodule of one (never ``pkg.__main__``)."""
        for m in self.allow_modules:
            if module == m:
                return True
            if module.startswith(m + ".") and all(_public(p) for p in module[len(m) + 1:].split(".")):
                return True
        return False

    def resolve(self, function: str) -> Callable[..., Any]:
        """The function ``function`` names, or ``PermissionDenied``; imports only an allowed module."""
        if ":" not in function:
            fn = self.functions.get(function)
            if fn is None:
                registered = ", ".join(sorted(self.functions)) or "none"
                raise PermissionDenied(f"{function!r} is not a function registered on this task (registered: "
                                       f"{registered}); {_HINT}", function=function)
            return fn
        module_name, _, attr = function.partition(":")
        parts = module_name.split(".")
        if not all(p.isidentifier() for p in parts) or not _public(attr):
            raise PermissionDenied(f"{function!r} may not run: name a public top-level function as "
                                   f"'package.module:function' (no dots after ':', no names starting with '_'); "
                                   f"{_HINT}", function=function)
        if not self.allowed(module_name):
            allowed = ", ".join(self.allow_modules) or "nothing (start the task with --allow-module)"
            raise PermissionDenied(f"{function!r} may not run: module {module_name!r} is not on this task's "
                                   f"allow-list; allowed: {allowed}", function=function)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise NotFound(f"cannot import {module_name!r}: {exc}") from None
        fn = vars(module).get(attr)  # the module's own namespace: no module __getattr__, no descriptors
        if not inspect.isfunction(fn) or fn.__module__ != module_name:
            what = "nothing" if fn is None else f"a {type(fn).__name__}" if not inspect.isfunction(fn) else \
                f"a function imported from {fn.__module__!r}"
            raise PermissionDenied(f"{function!r} may not run: {module_name}.{attr} is {what}, not a function "
                                   f"defined in {module_name!r}; {_HINT}", function=function)
        return fn

    @op(rq.Run)
    async def run(self, ctx: CallContext, req: rq.Run) -> Any:
        """Call a registered function or ``package.module:function(*args, **kwargs)``; coroutines
        are awaited, plain functions run on a thread so the task keeps serving."""
        fn = self.resolve(req.function)
        args, kwargs = req.args or [], req.kwargs or {}
        if _is_async(fn):
            return await fn(*args, **kwargs)
        with self._count:
            full = self._running >= self.max_threads
            if not full:
                self._running += 1
        if full:
            raise ResourceExhausted(
                f"worker.run {req.function!r}: {self.max_threads} plain functions are already running on this "
                f"task (cancelled calls' threads run until they return), its limit max_run_threads "
                f"{self.max_threads} (zmqflow serve --max-run-threads)", function=req.function, limit=self.max_threads)
        return await _on_a_thread(lambda: fn(*args, **kwargs), self._ended)

    def _ended(self) -> None:
        with self._count:
            self._running -= 1


def _on_a_thread(call: Callable[[], Any], ended: Callable[[], None]) -> "asyncio.Future[Any]":
    """``call()`` on a daemon thread of its own, then ``ended()`` on it once ``call`` returns. Not the
    loop's default executor: it is joined when the loop closes and at exit, so a function that
    blocks would keep a stopped task's process alive."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():  # the call was cancelled (its deadline, the server stopping)
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (call(), None)
        except BaseException as exc:  # handed to the caller, as the executor would
            outcome = (None, exc)
        finally:
            ended()  # before the caller hears of it, so its next call finds the slot free
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for it
            pass

    try:
        threading.Thread(target=run, name="zmqflow-run", daemon=True).start()
    except BaseException:  # no thread (RuntimeError: can't start new thread): it never counted
        ended()
        raise
    return fut
