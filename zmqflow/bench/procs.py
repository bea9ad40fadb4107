"""Server processes for the benchmarks: spawned, told when to stop over a pipe, always reaped.

Every benchmark server (a zmqflow task server or a raw pyzmq baseline) is a process entry
``target(*args, conn)`` that answers ``("ready", value)`` or ``("error", message)`` on ``conn``
and returns once ``conn`` becomes readable (a stop message, or EOF when the parent is gone), so a
benchmark that dies leaves no server behind.

Where what is measured is the task process itself (its resident memory), :class:`Served` runs the
real one instead, ``zmqflow serve`` per task, which the OS stops (SIGTERM) if the benchmark dies.

Every baseline (raw pyzmq, gloo, TF's gRPC) runs plaintext, so every zmqflow process a benchmark
starts does too: ``ZMQFLOW_KEYS`` is dropped in each of them (:func:`zf_task_process`, the ranks of
:func:`run_to_end`, :class:`Served`), and :func:`plaintext` drops it from the benchmark's own
process (its zmqflow clients) while it runs. Rows say so (``security``: :data:`SECURITY`).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .. import loop as zf_loop
from ..cluster import ClusterSpec
from ..server.idle_trim import IDLE_TRIM
from ..server.task import AsyncServer
from ..transport.curve import KEYS_ENV
from ..transport.memory import keep_big_blocks, settle_gc

__all__ = ["SECURITY", "Child", "Procs", "Served", "plaintext", "reap", "run_to_end", "spawn_queue",
           "zf_keyed_task_process", "zf_task_process"]

_SPAWN = multiprocessing.get_context("spawn")  # no forked copies of this process's sockets and threads
SECURITY = "plaintext"  # what both sides of every benchmark but the transport's CURVE pass run


@contextlib.contextmanager
def plaintext() -> Iterator[str]:
    """``ZMQFLOW_KEYS`` out of this process's environment meanwhile (put back after): its zmqflow
    clients, and every process started meanwhile, run plaintext as the baselines do. Yields
    :data:`SECURITY`, for the rows."""
    saved = os.environ.pop(KEYS_ENV, None)
    try:
        yield SECURITY
    finally:
        if saved is not None:
            os.environ[KEYS_ENV] = saved


def reap(proc: Any, grace: float = 10.0) -> None:
    """Wait ``grace`` seconds for ``proc`` to exit, then terminate it, then kill it."""
    proc.join(max(0.0, grace))
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def zf_task_process(spec_json: str, task: str, conn: Any) -> None:
    """Process entry: the zmqflow task server of ``task`` on ``zmqflow.loop.run``, plaintext
    whatever ``ZMQFLOW_KEYS`` it inherited; answers its target."""
    zf_keyed_task_process(spec_json, task, "", conn)


def zf_keyed_task_process(spec_json: str, task: str, keys: str, conn: Any) -> None:
    """:func:`zf_task_process` with CurveZMQ keys from the directory ``keys`` ('': plaintext)."""
    if keys:
        os.environ[KEYS_ENV] = keys
    else:
        os.environ.pop(KEYS_ENV, None)
    keep_big_blocks()  # as `zmqflow serve` does
    zf_loop.run(_serve(spec_json, task, conn))


async def _serve(spec_json: str, task: str, conn: Any) -> None:
    try:
        server = AsyncServer(ClusterSpec.from_json(spec_json), task, idle_trim=IDLE_TRIM)  # as `zmqflow serve`
        await server.start()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    settle_gc()  # as `zmqflow serve`
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_reader(conn.fileno(), stop.set)  # a stop message or EOF (parent gone)
    try:
        conn.send(("ready", server.target))
        await stop.wait()
    finally:
        loop.remove_reader(conn.fileno())
        await server.stop()


class Child:
    """One spawned server process and its pipe: started here, ``wait_ready`` for what it answers."""

    def __init__(self, target: Callable[..., None], args: Sequence[Any], name: str):
        self.name = name
        self.conn, child_conn = _SPAWN.Pipe()
        self.proc = _SPAWN.Process(target=target, args=(*args, child_conn), name=name, daemon=True)
        self.proc.start()
        child_conn.close()

    def wait_ready(self, timeout: float = 60.0) -> Any:
        """The value the server answered once ready; raises RuntimeError with its error if it failed."""
        if not self.conn.poll(timeout):
            raise RuntimeError(f"{self.name} did not start within {timeout:g}s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"{self.name} exited (code {self.proc.exitcode}) before it was ready") from None
        if status != "ready":
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("stop", None))
        reap(self.proc)
        self.conn.close()


class Procs:
    """Servers started one after the other, each ready before the next; ``close`` stops them all."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, target: Callable[..., None], *args: Any) -> Any:
        """Start ``target(*args, conn)``; returns what it answered once ready."""
        child = Child(target, args, f"benchmark server {len(self.children)}")
        self.children.append(child)
        return child.wait_ready()

    def close(self) -> None:
        for child in self.children:
            with contextlib.suppress(OSError, ValueError):
                child.conn.send(("stop", None))  # all at once: they stop in parallel
        for child in self.children:
            child.stop()

    @property
    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]


# Runs in the task's process before it becomes `zmqflow serve` (execv keeps the setting): SIGTERM
# when the benchmark that started it dies, so none outlives it.
_ORPHAN_STOP = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "if os.getppid() != int(sys.argv[1]):\n    sys.exit(1)  # the benchmark is already gone\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'zmqflow', 'serve', *sys.argv[2:]])\n"
)


class Served:
    """``zmqflow serve`` of every task of ``spec``, the process a deployment runs for a task;
    ``close`` stops them (SIGTERM, as an operator would, then SIGKILL) and reaps them."""

    def __init__(self, spec: ClusterSpec, *args: str):
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []
        argv = [sys.executable, "-c", _ORPHAN_STOP, str(os.getpid())] if sys.platform.startswith("linux") else \
            [sys.executable, "-m", "zmqflow", "serve"]
        env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}  # plaintext, as the baselines
        try:
            for t in spec.tasks:
                log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
                self.logs.append(log)
                self.procs.append(subprocess.Popen(
                    [*argv, "--cluster", spec.to_json(), "--task", str(t), "--log-level", "warning", *args],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env))
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        """RuntimeError, with its output, if a task process has exited."""
        for p, log in zip(self.procs, self.logs):
            if p.poll() is not None:
                log.seek(0)
                tail = log.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"zmqflow serve exited (code {p.returncode}): {tail}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()  # all at once: they stop in parallel, each within 2 s
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for log in self.logs:
            log.close()


def _plaintext_rank(target: Callable[..., None], *args: Any) -> None:
    """Process entry of :func:`run_to_end`: ``target(*args)`` without ``ZMQFLOW_KEYS``."""
    os.environ.pop(KEYS_ENV, None)
    target(*args)


def run_to_end(target: Callable[..., None], argsets: Sequence[tuple], timeout: float) -> None:
    """Run one process per argument tuple (every rank of a collective), plaintext, and wait for all
    of them; raises RuntimeError if any fails or is still running after ``timeout`` seconds."""
    procs = [_SPAWN.Process(target=_plaintext_rank, args=(target, *a), daemon=True) for a in argsets]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"a benchmark rank failed (exit codes {bad})")


def spawn_queue() -> Any:
    """A queue the processes of :func:`run_to_end` can put results on."""
    return _SPAWN.Queue()
