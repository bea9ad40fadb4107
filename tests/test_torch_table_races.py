"""Torch tables opened at once by several processes: one that names no optimizer attaches with the
optimizer of a table another process declared with one, even while that table's parts are still
being made (its catalog record not ready yet)."""

from __future__ import annotations

import asyncio
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.testing import make_spec

torch = pytest.importorskip("torch")

from zmqflow.torch.embedding import EmbeddingBag  # noqa: E402

ADAM = zf.optim.Adam(0.1)
WAIT_S = 30.0


@pytest.fixture
def cluster() -> Iterator[types.SimpleNamespace]:
    """Two ps shards and two workers, a session on each worker (two processes' worth of callers)."""
    spec = make_spec({"worker": 2, "ps": 2}, "tcp")
    servers: list[zf.Server] = []
    sessions: list[zf.Session] = []
    try:
        servers += [zf.Server(spec, f"ps:{i}") for i in range(2)]
        servers += [zf.Server(spec, f"worker:{i}") for i in range(2)]
        for server in servers[2:]:
            sessions.append(zf.Session(server.target, timeout=WAIT_S))
            sessions[-1].wait_for_cluster(WAIT_S)
        yield types.SimpleNamespace(a=sessions[0], b=sessions[1])
    finally:
        for sess in sessions:
            sess.close()
        for server in servers:
            server.stop()


def _hold_creates(sess: zf.Session, release: threading.Event) -> threading.Event:
    """Make ``sess`` wait for ``release`` before each part it creates (its record stays not ready
    meanwhile); the event set once it has begun to create one."""
    began = threading.Event()
    inner = sess.async_session.call_task

    async def call_task(task: Any, service: str, op: str, body: Any = None, **kwargs: Any) -> Any:
        if op == "emb_create":
            began.set()
            await asyncio.get_running_loop().run_in_executor(None, release.wait, WAIT_S)
        return await inner(task, service, op, body, **kwargs)

    sess.async_session.call_task = call_task
    return began


def _note_first_declare(sess: zf.Session) -> threading.Event:
    """An event set once the catalog has answered ``sess``'s first declaration (or refused it)."""
    answered = threading.Event()
    inner = sess.async_session.call_catalog

    async def call_catalog(op: str, body: Any, timeout: float | None = None) -> Any:
        try:
            return await inner(op, body, timeout)
        finally:
            if op == "declare":
                answered.set()

    sess.async_session.call_catalog = call_catalog
    return answered


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``fn`` started on a thread; the list gets what it returned or raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _result(thread: threading.Thread, out: list[Any]) -> Any:
    thread.join(WAIT_S)
    assert not thread.is_alive() and len(out) == 1, "an open did not return"
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def test_an_open_naming_no_optimizer_attaches_to_a_table_still_being_made_with_one(cluster):
    """The process that names Adam holds the catalog's claim and is making the parts when the one
    that names none declares: the record is not ready, so no lookup finds it, and a declaration of
    the default (SGD) is refused by the catalog. The opener attaches with Adam, waiting for the
    parts, and both train the one Adam table."""
    release = threading.Event()
    creating = _hold_creates(cluster.b, release)
    answered = _note_first_declare(cluster.a)
    named = _in_thread(lambda: EmbeddingBag("race", 10, 2, mode="sum", optimizer=ADAM, session=cluster.b))
    try:
        assert creating.wait(WAIT_S), "the declarer naming Adam never began to create the parts"
        unnamed = _in_thread(lambda: EmbeddingBag("race", 10, 2, mode="sum", session=cluster.a))
        assert answered.wait(WAIT_S), "the opener naming no optimizer never reached the catalog"
    finally:
        release.set()
    b, a = _result(*named), _result(*unnamed)
    assert a.optimizer == b.optimizer == ADAM.spec()
    before = a.weight
    a(torch.tensor([[1, 2]])).sum().backward()  # a gradient of 1 per element: Adam's first step is lr
    a.flush()
    moved = (before - b.weight)[[1, 2]]
    np.testing.assert_allclose(moved.numpy(), 0.1, rtol=1e-3)  # SGD(0.01) would have moved 0.01
