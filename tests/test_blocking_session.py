"""The blocking session's loop thread: an interrupted call ends before it raises, a blocking call
on the loop's own thread fails at once instead of freezing every caller, and a session dropped
without ``close()`` still closes its connections and stops its thread."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.loop import LoopThread
from zmqflow.testing import REPLY, FaultInjector, faulty_cluster, make_spec, wait_until
from zmqflow.transport.zeromq import ZmqTransport, open_connections

SESSION_THREAD = "zmqflow-session"


@dataclass
class Cluster:
    """A ps and a worker on a loop thread of their own; ``faults`` acts on what they send."""

    target: str
    faults: FaultInjector
    thread: LoopThread

    def there(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the cluster's loop (the injector's rules and releases belong there)."""

        async def now() -> Any:
            return fn()

        return self.thread.call(now(), timeout=10)


@contextlib.contextmanager
def served() -> Iterator[Cluster]:
    """The cluster over ZeroMQ tcp, its servers behind a fault injector: a blocking session in
    this thread talks plain ZeroMQ to them, and a REPLY rule holds what they answer it (picked by
    server and client: the injector knows the op of a request only where it sent it)."""
    thread = LoopThread("test-cluster")
    got: dict[str, Any] = {}
    ready = threading.Event()

    async def serve() -> None:
        stop = asyncio.Event()
        spec = make_spec({"ps": 1, "worker": 1}, "tcp")
        async with faulty_cluster(spec, timeout=20, inner=ZmqTransport()) as (servers, faults):
            got.update(target=servers["worker:0"].target, faults=faults, stop=stop)
            ready.set()
            await stop.wait()

    running = thread.submit(serve())
    try:
        wait_until(lambda: ready.is_set() or running.done(), 30, what="the cluster up")
        if not ready.is_set():
            running.result()
        yield Cluster(got["target"], got["faults"], thread)
    finally:
        if ready.is_set():
            thread.loop.call_soon_threadsafe(got["stop"].set)
        running.result(30)
        thread.stop()


def _session_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == SESSION_THREAD]


async def _other_tasks() -> list[str]:
    """The coroutines of the tasks on the running loop, but this one's."""
    me = asyncio.current_task()
    return [t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not me]


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the main thread, as at a terminal's Ctrl-C."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_during_a_read_ends_its_task_before_it_raises(sigint_raises):
    assert threading.current_thread() is threading.main_thread()
    with served() as cluster, zf.Session(cluster.target, timeout=20) as sess:
        v = sess.variable("w", np.arange(1, 5, dtype=np.float32))
        buf = np.zeros(4, dtype=np.float32)
        mine = f"{sess.name}-"  # the start of the routing identity of each of its connections
        held = cluster.there(lambda: cluster.faults.hold(direction=REPLY, server="ps:0",
                                                          when=lambda p: p.client.startswith(mine)))
        main = threading.main_thread().ident
        assert main is not None

        def interrupt_once_held() -> None:
            wait_until(lambda: held.fired, 10, what="the read's reply held")
            signal.pthread_kill(main, signal.SIGINT)

        interrupter = threading.Thread(target=interrupt_once_held)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                v.read(out=buf, timeout=15)
        finally:
            interrupter.join(15)
        assert "AsyncVariable.read" not in sess.run_on_loop(_other_tasks(), timeout=5)
        assert cluster.there(held.release) == 1
        # replies on a connection come in order: the held one has arrived when the next one has
        assert np.array_equal(v.read(timeout=10), np.arange(1, 5, dtype=np.float32))
        assert not buf.any(), "the interrupted read wrote into the caller's array after it raised"


def _on_loop_thread(sess: zf.Session, call: Callable[[], Any]) -> tuple[threading.Event, dict[str, Any]]:
    """Run ``call`` in a done callback, which concurrent.futures runs on the session's loop thread:
    (set once it began; what it raised, as "error", and how long it took, as "secs", once over)."""
    entered = threading.Event()
    seen: dict[str, Any] = {}

    def on_done(_: Any) -> None:
        entered.set()
        start = time.monotonic()
        try:
            call()
        except BaseException as exc:  # recorded for the test's thread to judge
            seen["error"] = exc
        seen["secs"] = time.monotonic() - start

    sess.submit(sess.async_session.global_step()).add_done_callback(on_done)
    return entered, seen


def test_a_blocking_call_on_the_loop_thread_raises_at_once_and_others_go_on():
    with served() as cluster, zf.Session(cluster.target, timeout=2) as sess:
        v = sess.variable("w", np.arange(4, dtype=np.float32))
        entered, seen = _on_loop_thread(sess, v.read)
        assert entered.wait(10)
        assert np.array_equal(v.read(timeout=1), np.arange(4, dtype=np.float32))  # the loop is not frozen
        wait_until(lambda: "secs" in seen, 10, what="the callback's call over")
        assert isinstance(seen.get("error"), RuntimeError) and "async_session" in str(seen["error"])
        assert seen["secs"] < 0.5


def test_close_from_a_done_callback_waits_for_nothing_and_still_closes():
    with served() as cluster:
        before = set(_session_threads())
        sess = zf.Session(cluster.target, timeout=2)
        sess.variable("w", np.arange(4, dtype=np.float32)).read()
        _, seen = _on_loop_thread(sess, sess.close)
        wait_until(lambda: "secs" in seen, 10, what="the callback's close over")
        assert "error" not in seen and seen["secs"] < 0.5
        wait_until(lambda: not set(_session_threads()) - before, 10, what="the session's thread ended")
        assert sess.async_session.closed
        sess.close()  # again, from here: nothing left to do
    assert not open_connections()


def test_a_session_dropped_unclosed_stops_its_thread_and_closes_its_connections():
    with served() as cluster:
        before = set(_session_threads())
        sess = zf.Session(cluster.target, timeout=10)
        v = sess.variable("w", np.arange(4, dtype=np.float32))
        assert np.array_equal(v.read(), np.arange(4, dtype=np.float32))
        gone = weakref.ref(sess)
        del sess, v
        gc.collect()
        assert gone() is None
        wait_until(lambda: not set(_session_threads()) - before, 10, what="the dropped session's thread ended")
    # the cluster's own connections closed with it: any still open are the session's
    wait_until(lambda: not open_connections(), 10, what="every connection closed")
