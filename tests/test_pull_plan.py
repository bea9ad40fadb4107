"""Plans kept for pulls and pushes that read back (``client/pull_plan.py``, ``push_read.ReadPlan``):
reused for the same records and names only, a session's last few, gone with the session; the
values each step reads are the step's, whatever was kept."""

from __future__ import annotations

import gc

import numpy as np

import zmqflow as zf
from zmqflow.client import pull_plan, push_read
from zmqflow.client.bulk_pull import BULK_FROM
from zmqflow.client.var_info import VarInfo
from zmqflow.cluster import TaskId
from zmqflow.testing import local_cluster

from .conftest import arun


class _Sess:
    """A session as the plans key it: any object, held weakly."""


def _info(name: str, rows: int = 4, tasks: tuple[int, ...] = (0,)) -> VarInfo:
    cut = [rows * i // len(tasks) for i in range(len(tasks) + 1)]
    parts = tuple((TaskId("ps", t), a, b) for t, a, b in zip(tasks, cut, cut[1:]))
    return VarInfo(name, (rows, 3), np.dtype(np.float32), parts, None, None)


def test_a_plan_is_kept_for_the_same_records_and_names_only():
    sess, infos = _Sess(), [_info("a"), _info("b", tasks=(0, 1))]
    made = pull_plan.make(infos, {})
    pull_plan.keep(sess, made, {})
    assert pull_plan.kept(sess, list(infos), {}) is made
    assert pull_plan.kept(sess, [_info("a"), infos[1]], {}) is None  # an equal record, but another object
    assert pull_plan.kept(sess, infos[::-1], {}) is None and pull_plan.kept(sess, infos, {"a": None}) is None
    assert pull_plan.kept(_Sess(), infos, {}) is None
    assert [(t, len(keys), [it.name for it in req.items]) for t, keys, req, _ in made.calls] == [
        (TaskId("ps", 0), 2, ["a", "b"]), (TaskId("ps", 1), 1, ["b"])]
    assert made.names == {"a": None, "b": None} and [i.name for i in made.fresh] == ["b"]  # b: two parts
    big = [_info("big", rows=BULK_FROM // 12 + 1)]  # a share that could take the shard's bulk stream
    pull_plan.keep(sess, pull_plan.make(big, {}), {})
    assert pull_plan.kept(sess, big, {}) is None  # whether it does is the session's state: planned each time


def test_a_session_keeps_its_last_plans_and_they_go_with_it():
    sess = _Sess()
    lists = [[_info(f"v{i}")] for i in range(pull_plan.PLANS + 1)]
    for infos in lists:
        pull_plan.keep(sess, pull_plan.make(infos, {}), {})
    assert pull_plan.kept(sess, lists[0], {}) is None  # the oldest went
    assert all(pull_plan.kept(sess, infos, {}) is not None for infos in lists[1:])
    del sess
    gc.collect()
    assert len(pull_plan._PULLS._by_sess) == 0


def test_a_read_back_plan_says_what_cannot_read_back():
    big = _info("big", rows=push_read.READ_BYTES // 12)
    assert not push_read.readable({big: np.zeros((big.shape[0], 3), np.float32)})
    sess, small = _Sess(), _info("s")
    grads = {small: np.zeros((4, 3), np.float32)}
    assert push_read.readable(grads, sess) and push_read.plan(sess, grads, ()) is push_read.plan(sess, grads, ())
    assert not push_read.readable({small: None}, sess)


def test_kept_plans_read_each_steps_values():
    async def main() -> None:
        async with local_cluster({"ps": 2, "worker": 1}, timeout=20) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1)
                names = [f"v{i}" for i in range(6)]
                for i, n in enumerate(names):
                    await sess.variable(n, np.full((3, 2), i, np.float32), optimizer=opt,
                                        partitioner=zf.fixed_size_partitioner(2) if i % 2 else None)
                grads = {n: np.ones((3, 2), np.float32) for n in names}
                out = {n: np.empty((3, 2), np.float32) for n in names[:3]}
                for step in range(1, 4):
                    got = await sess.push_pull(grads)
                    again, into = await sess.pull(names), await sess.pull(names, out=out)
                    for i, n in enumerate(names):
                        assert np.all(got[n] == i - step) and np.all(again[n] == i - step) and np.all(into[n] == i - step)
                    assert all(into[n] is out[n] for n in names[:3])

    arun(main())
