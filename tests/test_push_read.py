"""A small group's read-back in its push's own answer (``Push.read``, :mod:`zmqflow.client.push_read`):
one push request a shard and no pull; the values a pull would read; a bad read refused before
anything is applied; an answer without its rows refused, its step kept."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.client import push_read
from zmqflow.client.var_info import VarInfo
from zmqflow.cluster import TaskId
from zmqflow.errors import InvalidArgument, NotFound, ProtocolError
from zmqflow.rpc.counters import frames_nbytes
from zmqflow.rpc.dedup import MAX_KEPT_REPLY
from zmqflow.server.services.ps import answer_bytes
from zmqflow.testing import local_cluster
from zmqflow.wire.codec import encode_reply
from zmqflow.wire.requests import ps as rq

from .conftest import arun


def _recording(sess: zf.AsyncSession, monkeypatch: pytest.MonkeyPatch, ops: list[str],
               change: Any = None) -> None:
    """Note each ps op the session sends; ``change`` may rewrite a push's answer."""
    call_task = sess.call_task

    async def recorded(task: Any, service: str, op: str, body: Any = None, **kw: Any) -> Any:
        ops.append(op)
        answer = await call_task(task, service, op, body, **kw)
        return change(answer) if change is not None and op == "push" else answer

    monkeypatch.setattr(sess, "call_task", recorded)


@contextlib.asynccontextmanager
async def _one_sync_variable(monkeypatch: pytest.MonkeyPatch, ops: list[str],
                             change: Any = None) -> AsyncIterator[zf.AsyncSession]:
    """A session on a one-shard cluster holding ``w`` (2 float32, SGD(1) averaged over one
    replica), its ps ops noted in ``ops`` (``change`` may rewrite a push's answer)."""
    async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
        async with zf.AsyncSession(servers["worker:0"].target) as sess:
            opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1)
            await sess.variable("w", np.zeros(2, np.float32), optimizer=opt)
            _recording(sess, monkeypatch, ops, change)
            yield sess


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_a_small_step_comes_back_in_one_push_a_shard(monkeypatch: pytest.MonkeyPatch, transport: str):
    async def main() -> None:
        async with local_cluster({"ps": 2, "worker": 1}, timeout=20, transport=transport) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                sgd = zf.optim.SGD(0.5)
                split = await sess.variable("split", np.zeros((6, 3), np.float32), optimizer=sgd,
                                            partitioner=zf.fixed_size_partitioner(2))
                await sess.variable("scalar", np.float64(1.0), optimizer=sgd)
                await sess.variable("b", np.full(4, 2.0, np.float32), optimizer=sgd)
                await sess.variable("o", np.zeros(2, np.int64))  # a plain add
                shards = {task for info in [split.info] for task, _, _ in info.parts}
                assert len(shards) == 2, "the split variable has a part on each shard"
                ops: list[str] = []
                _recording(sess, monkeypatch, ops)
                grads = {"split": np.arange(18, dtype=np.float32).reshape(6, 3), "scalar": np.float64(4.0),
                         "b": np.ones(4, np.float32), "o": np.array([3, 4], np.int64)}
                out = np.empty(2, np.int64)
                values = await sess.push_pull(grads, out={"o": out})
                assert sorted(ops) == ["push", "push"], ops  # one a shard, each answered with its rows
                assert values["o"] is out and out.tolist() == [3, 4]
                np.testing.assert_array_equal(values["split"], -0.5 * grads["split"])
                assert values["scalar"] == -1.0 and values["scalar"].shape == ()
                np.testing.assert_array_equal(values["b"], np.full(4, 1.5, np.float32))
                # an inproc shard's rows are its own memory: read-only, as a pull's
                assert values["b"].flags.writeable is (transport != "inproc")
                monkeypatch.undo()
                again = await sess.pull(list(grads))
                for name, value in values.items():
                    np.testing.assert_array_equal(again[name], value)

    arun(main())


def test_a_push_whose_read_names_a_bad_part_applies_nothing():
    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1)
                w = await sess.variable("w", np.zeros(3, np.float32), optimizer=opt)
                task = w.info.parts[0][0]
                grad = [rq.RowsItem("w", 0, 0, 3, np.ones(3, np.float32))]
                for read, error, match in (([rq.PullItem("nope", 0, None, None)], NotFound, "nope"),
                                           ([rq.PullItem("w", 0, 0, 9)], InvalidArgument, "w"),
                                           ([rq.PullItem("w", 4, None, None)], NotFound, "w")):
                    with pytest.raises(error, match=match):
                        await sess.call_task(task, "ps", "push", rq.Push(dense=grad, step=0, read=read))
                assert (await w.read()).tolist() == [0, 0, 0] and await sess.global_step() == 0
                answer = await sess.call_task(task, "ps", "push", rq.Push(dense=grad, step=0, read=[
                    rq.PullItem("w", 0, 1, 3), rq.PullItem("w", 0, None, None)]))
                assert answer["step"] == 1 and [v.tolist() for v in answer["values"]] == [[-1, -1], [-1, -1, -1]]

    arun(main())


@pytest.mark.parametrize("answer", ["too few rows", "not arrays"])
def test_an_answer_with_bad_rows_is_refused_and_its_step_stands(monkeypatch: pytest.MonkeyPatch, answer: str):
    """ProtocolError naming the shard; the shards took the step, and the session counts it."""
    def strip(reply: dict[str, Any]) -> dict[str, Any]:
        reply = dict(reply)
        if answer == "too few rows":
            reply["values"] = reply["values"][:1]
        else:
            reply["values"] = [v.tolist() for v in reply["values"]]
        return reply

    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1)
                for name in "xy":
                    await sess.variable(name, np.zeros(2, np.float32), optimizer=opt)
                ops: list[str] = []
                _recording(sess, monkeypatch, ops, strip)
                grads = {"x": np.ones(2, np.float32), "y": np.ones(2, np.float32)}
                with pytest.raises(ProtocolError, match="ps:0 answered a push that reads back") as raised:
                    await sess.push_pull(grads, step=0)
                assert raised.value.details["pushed"] is True and sess.step == 1 and ops == ["push"]
                monkeypatch.undo()
                assert (await sess.pull(["x"]))["x"].tolist() == [-1, -1]

    arun(main())


def test_a_shard_that_sends_no_rows_is_pulled_from(monkeypatch: pytest.MonkeyPatch):
    """A shard answers ``values: None`` where a part it was to read is gone once a sync step was
    done: the step stands, and a pull reads the group (and says what is wrong, if anything)."""
    def none(reply: dict[str, Any]) -> dict[str, Any]:
        return {**reply, "values": None}

    async def main() -> None:
        ops: list[str] = []
        async with _one_sync_variable(monkeypatch, ops, none) as sess:
            got = await sess.push_pull({"w": np.ones(2, np.float32)}, step=0)
            assert ops == ["push", "pull"] and sess.step == 1 and got["w"].tolist() == [-1, -1]

    arun(main())


@pytest.mark.parametrize("count, elems, replicas, name", [
    (1, 14335, 1, "worker:{}"), (400, 35, 1, "worker:{}"), (500, 28, 1, "worker:{}"), (14335, 1, 1, "worker:{}"),
    (100, 143, 100, "worker:{}"), (1, 14335, 500, "/job:worker/replica:0/task:{}"), (3, 0, 0, "")])
def test_the_answer_is_never_bigger_than_the_shard_counts_it(count: int, elems: int, replicas: int, name: str):
    """``answer_bytes`` bounds the encoded answer from above, so an answer it keeps under what a
    server keeps of a reply is kept for a resent push."""
    values = [np.zeros(elems, np.float32) for _ in range(count)]
    names = sorted(name.format(i) for i in range(replicas)) or None
    answer = {"step": 1 << 40, "stale": False, "replicas": names, "global_step": 1 << 40, "values": values}
    encoded = frames_nbytes(encode_reply((1 << 62) + 12345, answer))
    assert answer_bytes(values, names) >= encoded


def test_rows_past_what_a_server_keeps_of_a_reply_come_back_too():
    """Rows of more than a server keeps of a reply for a resent request still come in the
    answer; the shard keeps the answer without them (``rpc.service.Answer``)."""
    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                w = await sess.variable("w", np.zeros(2, np.float32))
                await sess.variable("big", np.arange(MAX_KEPT_REPLY // 4, dtype=np.float32))
                task = w.info.parts[0][0]
                push = rq.Push(dense=[rq.RowsItem("w", 0, 0, 2, np.ones(2, np.float32))],
                               read=[rq.PullItem("w", 0, None, None), rq.PullItem("big", 0, None, None)])
                answer = await sess.call_task(task, "ps", "push", push)
                assert [v.tolist() for v in answer["values"]] == [[1, 1], list(range(MAX_KEPT_REPLY // 4))]
                assert (await w.read()).tolist() == [1, 1]

    arun(main())


@pytest.mark.parametrize("kept", [True, False])
def test_a_resent_push_is_told_its_step_and_its_rows_where_they_were_kept(monkeypatch: pytest.MonkeyPatch,
                                                                          kept: bool):
    """The answer to a push that reads back is lost; the client sends it again under the same id.
    Rows a shard kept with the answer (small) come again; bigger ones do not, and the group is
    pulled. Either way the step is applied once, and counted."""
    from zmqflow.testing import faulty_cluster
    from zmqflow.transport.faults import REPLY

    n = 1024 if kept else (push_read.READ_BYTES - push_read.ITEM_BYTES - 1) // 4  # the most read back at once

    async def main() -> None:
        async with faulty_cluster({"ps": 1, "worker": 1}, timeout=20) as (servers, faults):
            async with zf.AsyncSession(servers["worker:0"].target, timeout=10) as sess:
                sess.client.retry_interval = 0.1
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1)
                await sess.variable("w", np.zeros(n, np.float32), optimizer=opt)
                ops: list[str] = []
                _recording(sess, monkeypatch, ops)
                rule = faults.drop(op="ps.push", direction=REPLY, times=1)
                got = await sess.push_pull({"w": np.ones(n, np.float32)}, step=0)
                assert rule.fired == 1 and ops == (["push"] if kept else ["push", "pull"])
                assert sess.step == 1 and await sess.global_step() == 1
                assert np.all(got["w"] == -1.0) and np.all((await sess.pull(["w"]))["w"] == -1.0)

    arun(main())


def test_only_small_dense_groups_read_back():
    def Info(nbytes: int, tasks: str = "a", sync: bool = False) -> VarInfo:  # noqa: N802  # bytes, one a row
        shards = [TaskId("ps", "ab".index(t)) for t in tasks]
        parts = tuple((t, i * nbytes // len(shards), (i + 1) * nbytes // len(shards)) for i, t in enumerate(shards))
        return VarInfo("v", (nbytes,), np.dtype(np.uint8), parts, {"kind": "sync_replicas"} if sync else None, None)

    small, limit = Info(1000), push_read.READ_BYTES - push_read.ITEM_BYTES
    assert push_read.readable({small: np.ones(2)}) and push_read.readable({Info(limit - 1): np.ones(2)})
    assert not push_read.readable({Info(limit): np.ones(2)})  # a pull from here would take a bulk stream
    assert push_read.readable({Info(limit, "ab"): np.ones(2)})  # half on each of two shards
    many = {Info(100): np.ones(2) for _ in range(push_read.READ_BYTES // 100)}  # rows under the limit
    assert not push_read.readable(many)  # but each part costs the answer more than its rows
    assert not push_read.readable({small: (np.array([0]), np.ones((1,)))})  # sparse: the push carries no part whole
    assert not push_read.readable({small: None})  # absent
    assert not push_read.readable({small: np.ones(2), Info(limit - 1000): np.ones(2)})  # one shard's share
    assert push_read.readable({Info(10, sync=True): np.ones(2), Info(10, "b", sync=True): np.ones(2)})
    assert not push_read.readable({small: np.ones(2), Info(10, "b", sync=True): np.ones(2)})  # sync beside async


def test_a_shard_older_than_read_is_pushed_to_without_it_and_pulled(monkeypatch: pytest.MonkeyPatch):
    """A shard whose ``ps.push`` declares no ``read`` refuses it before applying anything: the push
    goes again without it and the group is pulled, and that shard is not asked to read again."""
    import msgspec

    from zmqflow.rpc import op
    from zmqflow.server.services.ps import PsService
    from zmqflow.wire.requests.base import Request

    fields = [(f.name, f.type, f.default if f.default is not msgspec.NODEFAULT
               else msgspec.field(default_factory=f.default_factory))
              for f in msgspec.structs.fields(rq.Push) if f.name != "read"]
    older = msgspec.defstruct("Push", fields, bases=(Request,))  # ps.push as declared before ``read``
    push = PsService.push

    @op(older)
    def older_push(self: PsService, ctx: Any, req: Any) -> Any:
        return push(self, ctx, rq.Push(**{name: getattr(req, name) for name, _, _ in fields}))

    monkeypatch.setattr(PsService, "push", older_push)

    async def main() -> None:
        ops: list[str] = []
        async with _one_sync_variable(monkeypatch, ops) as sess:
            for step in (1, 2):
                got = await sess.push_pull({"w": np.ones(2, np.float32)})
                assert got["w"].tolist() == [-step, -step] and sess.step == step
            assert ops == ["push", "push", "pull", "push", "pull"]  # asked to read once, refused

    arun(main())
