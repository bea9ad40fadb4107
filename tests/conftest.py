"""Shared test helpers: a diagnostics service, a bounded async runner, process helpers."""

from __future__ import annotations

import asyncio
import compileall
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any

import numpy as np
import pytest

from zmqflow.bench.transport.plan import Plan
from zmqflow.errors import InvalidArgument
from zmqflow.loop import run
from zmqflow.rpc import CallContext, Service, op
from zmqflow.transport.zeromq import open_connections
from zmqflow.wire import codec


# a transport benchmark plan of enough messages to fill every column, not to measure: for the
# tests that check its rows' wiring
BENCH_WIRING = Plan(reps=1, tput_bytes=1 << 20, tput_min_msgs=4, tput_max_msgs=64, lat_bytes=1 << 16, lat_min=20,
                    lat_max=50, memcpy_bytes=1 << 20)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the package's bytecode once, where the environment asks Python not to write it
    (PYTHONDONTWRITEBYTECODE): the hundreds of processes the suite starts then read it, each
    saving a quarter of a second of compiling, instead of compiling every module again."""
    import zmqflow

    compileall.compile_dir(os.path.dirname(zmqflow.__file__), quiet=2)


@pytest.fixture(autouse=True)
def no_connection_left_open():
    """Every test closes the ZeroMQ connections it opened. One left open retries its peer for as
    long as the run lasts, long after its loop is gone (until the garbage collector happens on
    it): a leak the suite once paid for with a stalled I/O thread."""
    yield
    left = open_connections()
    assert not left, f"connections left open (to {', '.join(left)}): close the session or client that opened them"


class DiagService(Service):
    """Ops that misbehave on request: fail, hang until the deadline, count calls."""

    name = "diag"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.never = asyncio.Event()

    @op
    def add(self, ctx: CallContext, a: int, b: int = 0) -> int:
        self.calls += 1
        return a + b

    @op
    def fail(self, ctx: CallContext, kind: str = "invalid") -> None:
        if kind == "invalid":
            raise InvalidArgument("diag.fail was asked to fail")
        raise ValueError("a plain ValueError from diag.fail")

    @op
    async def hang(self, ctx: CallContext) -> None:
        await self.never.wait()  # never set: the call can only end by its deadline or a disconnect


def arun(coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
    """Run ``coro`` on a fresh (uv)loop, bounded by ``timeout``."""

    async def bounded() -> Any:
        async with asyncio.timeout(timeout):
            return await coro

    return run(bounded())


class Proc:
    """A child process whose output lines are collected on a thread, so tests can wait on them."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, **kw: Any):
        full_env = dict(os.environ, PYTHONUNBUFFERED="1")
        full_env.pop("ZMQFLOW_CLUSTER", None)
        full_env.pop("ZMQFLOW_TASK", None)
        full_env.pop("TF_CONFIG", None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kw
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        """Every line of the output, until its end; then the pipe is closed here, by its only reader
        (left to the collector, its ResourceWarning fails a later test under ``-W error``)."""
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for raw in self.proc.stdout:
                with self._cond:
                    self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for_line(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if needle in line:
                        return line
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{needle!r} not seen within {timeout:g}s; output:\n" + "\n".join(self.lines))
                self._cond.wait(min(remaining, 0.2))

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout}s; its output:\n{self.output[-20000:]}") from None
        self._reader.join(5)
        return code

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(5)


ZMQFLOW = [sys.executable, "-m", "zmqflow"]


def launch_script(procs: Any, path: Any, text: str, *args: Any, workers: int, ps: int | None = None,
                  restart: bool = False, cluster_out: Any = None) -> "Proc":
    """Write ``text`` to the script ``path`` and run it on every worker under ``zmqflow launch``."""
    path.write_text(text)
    cmd = [*ZMQFLOW, "launch", "--workers", str(workers)]
    if ps is not None:
        cmd += ["--ps", str(ps)]
    if restart:
        cmd += ["--restart", "on-failure"]
    if cluster_out is not None:
        cmd += ["--cluster-out", str(cluster_out)]
    return procs([*cmd, "--", sys.executable, str(path), *map(str, args)])


def run_in_threads(target: Any, n: int, timeout: float = 60.0) -> None:
    """``target(i)`` for i in range(n), each in its own thread; fails with what any of them raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors


@pytest.fixture
def procs():
    """Processes started by a test; every one is killed at the end, whatever happened."""
    started: list[Proc] = []

    def start(argv: list[str], **kw: Any) -> Proc:
        p = Proc(argv, **kw)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:  # the test ended (failed, or timed out) with it still running: show why
            print(f"--- still running at teardown: {' '.join(p.proc.args)}\n{p.output[-20000:]}")
            p.signal(signal.SIGKILL)
        p.kill()


@pytest.fixture
def local():
    """The bridge runtime's private one-rank cluster (this process as worker:0, beside a ps:0)."""
    from zmqflow.bridge import runtime

    runtime.shutdown()
    runtime.init(timeout=20)
    yield
    runtime.shutdown()


def local_ps_strategy(sync: bool) -> tuple[Any, Any]:
    """(the session, a ``ParameterServerStrategy`` bound to it) on ``local``'s cluster, this
    process its only worker and chief."""
    import zmqflow as zf
    from zmqflow.bridge import runtime
    from zmqflow.training.context import TrainingContext

    rt = runtime.current()
    ctx = TrainingContext(spec=rt.spec, task=rt.task, session=rt.session, chief_task=rt.task, members=[rt.task])
    strategy = zf.ParameterServerStrategy(sync=sync)
    strategy.bind(ctx)
    return rt.session, strategy


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def compiled_codec() -> Iterator[None]:
    """The compiled codec switched on for the test, and back as it was after."""
    before = codec.use_compiled(True)
    try:
        yield
    finally:
        codec.use_compiled(before)


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """This process as the only rank of a private JAX cluster (worker:0 beside ps:0)."""
    zj = pytest.importorskip("zmqflow.jax")
    for name in ("ZMQFLOW_CLUSTER", "ZMQFLOW_TASK", "ZMQFLOW_TASK_JOB", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    runtime = zj.init(timeout=20)
    yield runtime
    zj.shutdown()


class SizeReadCalls(np.ndarray):
    """An array that, each time its size is read, calls ``on_read`` (when set): another thread
    changing a shard (a part created, a slot made) while this one reads its sizes."""

    on_read = None

    @property
    def nbytes(self) -> int:
        if self.on_read is not None:
            self.on_read()
        return super().nbytes
