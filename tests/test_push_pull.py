"""``Session.push_pull``: a push and a pull in one call, overlapped group by group. Every value it
returns includes the push; the groups' pushes go one at a time while earlier groups are pulled;
bad input is refused before any group is sent; the whole call keeps to one timeout."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.client import push_pull as pp
from zmqflow.client import push_read
from zmqflow.cluster import Address, ClusterSpec, TaskId
from zmqflow.errors import DeadlineExceeded, InvalidArgument, Unavailable
from zmqflow.testing import local_cluster

from .conftest import arun, local_ps_strategy


class _Info:
    """What ``groups`` and ``push_pull`` read of a variable: its name, size and parts."""

    def __init__(self, name: str, nbytes: int):
        self.name, self.nbytes = name, nbytes
        self.parts = [(TaskId.parse("ps:0"), 0, 1)]
        self.sync = False

    def __repr__(self) -> str:
        return self.name


def test_groups_are_runs_of_whole_variables_in_order():
    infos = [_Info(f"v{i}", n) for i, n in enumerate([3, 3, 3, 10, 1, 1, 1, 1])]
    # the target is 5 bytes (23 // 4; 5 the least): a group closes at 5, or before a variable passes it
    cut = pp.groups(infos, groups=4, least=5)
    assert [[i.name for i in g] for g in cut] == [["v0"], ["v1"], ["v2"], ["v3"], ["v4", "v5", "v6", "v7"]]
    big = [_Info("a", 10), _Info("b", 10), _Info("c", 100)]  # a big variable after small ones: a group of its own
    assert [[i.name for i in g] for g in pp.groups(big, groups=2, least=1)] == [["a", "b"], ["c"]]
    assert pp.groups(infos, groups=4, least=100) == [infos]  # a small model: one group, a push then a pull
    assert pp.groups([], groups=4) == []


def test_only_shards_on_this_host_by_their_address_count_as_local():
    for local in ("127.0.0.1:1", "localhost:1", "[::1]:1", "ipc:///tmp/x", "inproc://x", "127.8.9.1:2"):
        assert pp.on_this_host(Address.parse(local)), local
    for other in ("10.0.0.1:1", "example.org:1", "[2001:db8::1]:1"):
        assert not pp.on_this_host(Address.parse(other)), other


def test_values_include_the_push_and_match_a_push_then_a_pull(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(pp, "on_this_host", lambda _address: False)  # as if the shards were on other hosts
    monkeypatch.setattr(pp, "GROUP_BYTES", 1)  # a group per variable
    big = np.ones((1 << 18, 2), np.float32)  # 2 MiB: on the push stream
    async def main() -> None:
        async with local_cluster({"ps": 2, "worker": 1}, timeout=20, transport="tcp") as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                sgd = zf.optim.SGD(0.5)
                a = await sess.variable("a", np.zeros_like(big), optimizer=sgd)
                b = await sess.variable("b", np.full(4, 2.0, np.float32), optimizer=sgd)
                c = await sess.variable("c", np.zeros((8, 3), np.float32), optimizer=sgd)
                out = np.empty(4, np.float32)
                grads = {a: big, "b": np.ones(4, np.float32), c: (np.array([1, 1, 5]), np.ones((3, 3), np.float32))}
                values = await sess.push_pull(grads, out={"b": out})
                assert set(values) == {"a", "b", "c"}
                np.testing.assert_array_equal(values["a"], -0.5 * big)
                assert values["b"] is out
                np.testing.assert_array_equal(out, np.full(4, 1.5, np.float32))
                expect = np.zeros((8, 3), np.float32)
                expect[1], expect[5] = -1.0, -0.5  # row 1 twice, summed
                np.testing.assert_array_equal(values["c"], expect)
                # the same as push, then pull, at a push's own learning rate
                await sess.push_pull({"b": np.ones(4, np.float32)}, learning_rate=2.0)
                np.testing.assert_array_equal(await b.read(), np.full(4, -0.5, np.float32))
                # cut as asked, whatever the default: 2 groups of the three variables, on this host
                monkeypatch.setattr(pp, "on_this_host", lambda _address: True)
                seen: list[list[str]] = []
                cut = pp.groups
                monkeypatch.setattr(pp, "groups",
                                    lambda *a: seen.append([[i.name for i in g] for g in cut(*a)]) or cut(*a))
                await sess.push_pull(grads, groups=2)
                await sess.push_pull(grads)
                assert seen == [[["a"], ["b", "c"]], [["a", "b", "c"]]]

    arun(main())


def test_a_sync_step_is_complete_in_what_each_replica_reads():
    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 2}, timeout=20) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as s0, \
                    zf.AsyncSession(servers["worker:1"].target) as s1:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2)
                await s0.variable("w", np.zeros(3, np.float32), optimizer=opt)
                await s1.get("w")
                r0, r1 = await asyncio.gather(s0.push_pull({"w": np.ones(3, np.float32)}, step=0),
                                              s1.push_pull({"w": 3 * np.ones(3, np.float32)}, step=0))
                for got in (r0, r1):  # the mean of both replicas' gradients, applied before either read
                    np.testing.assert_array_equal(got["w"], np.full(3, -2.0, np.float32))
                assert s0.step == s1.step == 1

    arun(main())


def test_replicas_that_cut_a_sync_model_differently_do_not_wait_on_each_other():
    """Replica 0 pushes x, y, z, w; replica 1 the other way round, in 4 groups each. Were the
    pushes held back in turn, each replica's x (or w) step would wait for a push the other holds
    back until its own first groups are answered: neither would finish before the timeout."""
    async def main() -> None:
        async with local_cluster({"ps": 2, "worker": 2}, timeout=20) as servers:
            async with zf.AsyncSession(servers["worker:0"].target, timeout=8) as s0, \
                    zf.AsyncSession(servers["worker:1"].target, timeout=8) as s1:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2)
                names = ["x", "y", "z", "w"]
                for n in names:
                    await s0.variable(n, np.zeros(2, np.float32), optimizer=opt)
                    await s1.get(n)
                one = np.ones(2, np.float32)
                r0, r1 = await asyncio.gather(s0.push_pull({n: one for n in names}, step=0, groups=4),
                                              s1.push_pull({n: 3 * one for n in reversed(names)}, step=0, groups=4))
                for got in (r0, r1):
                    for n in names:
                        np.testing.assert_array_equal(got[n], np.full(2, -2.0, np.float32))

    arun(main())


@pytest.mark.parametrize("read", ["pull", "rows in the answer"])
def test_the_step_a_push_completed_stands_when_its_pull_fails(monkeypatch: pytest.MonkeyPatch, read: str):
    """The shards took the step: the session's step moves on, so its next push is not dropped
    as stale (it was, with the step left behind, and the other replicas waited for it). The same
    where the push's own answer carries the rows (a small group) and they fail to land."""
    def gone(*_a: Any) -> None:
        raise Unavailable("ps:0 is gone")

    async def lost(*a: Any) -> dict[str, Any]:
        gone()
        return {}

    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1)
                w = await sess.variable("w", np.zeros(2, np.float32), optimizer=opt)
                with monkeypatch.context() as m:
                    if read == "pull":
                        m.setattr(pp, "readable", lambda *_: False)
                        m.setattr(pp, "_pull", lost)
                    else:
                        m.setattr(push_read, "landed", gone)
                    with pytest.raises(Unavailable):
                        await sess.push_pull({"w": np.ones(2, np.float32)}, step=0)
                assert sess.step == 1 and sess.replicas is not None
                got = await sess.push_pull({"w": np.ones(2, np.float32)})  # at step 1: applied, not stale
                np.testing.assert_array_equal(got["w"], np.full(2, -2.0, np.float32))
                np.testing.assert_array_equal(await w.read(), got["w"])

    arun(main())


def test_a_pull_has_its_own_time_after_a_sync_push_that_waited_for_a_straggler(monkeypatch: pytest.MonkeyPatch):
    """Replica 1 pushes late: replica 0's push is answered near the end of its timeout, and its
    read-back (slowed here, as a big model over a link would be) still has a timeout of its own."""
    pull = pp._pull

    async def slow(*a: Any) -> dict[str, Any]:
        await asyncio.sleep(2.0)  # more than what the push leaves of a timeout shared with it (4 - 2.5)
        return await pull(*a)

    monkeypatch.setattr(pp, "_pull", slow)
    monkeypatch.setattr(pp, "readable", lambda *_: False)  # a model too big to come back in the push's answer

    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 2}, timeout=20) as servers:
            async with zf.AsyncSession(servers["worker:0"].target, timeout=4) as s0, \
                    zf.AsyncSession(servers["worker:1"].target, timeout=4) as s1:
                opt = zf.optim.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=2)
                await s0.variable("w", np.zeros(2, np.float32), optimizer=opt)
                await s1.get("w")

                async def late() -> dict[str, Any]:
                    await asyncio.sleep(2.5)  # replica 0's push waits for it: answered 1.5 s before its timeout
                    return await s1.push_pull({"w": np.ones(2, np.float32)}, step=0)

                r0, _ = await asyncio.gather(s0.push_pull({"w": np.ones(2, np.float32)}, step=0), late())
                np.testing.assert_array_equal(r0["w"], np.full(2, -1.0, np.float32))

    arun(main())


def test_bad_input_in_the_last_group_changes_nothing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(pp, "on_this_host", lambda _address: False)  # as if the shards were on other hosts
    monkeypatch.setattr(pp, "GROUP_BYTES", 1)  # a group per variable
    async def main() -> None:
        async with local_cluster({"ps": 1, "worker": 1}, timeout=10) as servers:
            async with zf.AsyncSession(servers["worker:0"].target) as sess:
                for n in "xyz":
                    await sess.variable(n, np.zeros(4, np.float32))
                ok = np.ones(4, np.float32)
                with pytest.raises(InvalidArgument, match="'z'.*shape"):
                    await sess.push_pull({"x": ok, "y": ok, "z": np.ones(5, np.float32)})
                with pytest.raises(InvalidArgument, match="'z'.*index 9"):
                    await sess.push_pull({"x": ok, "y": ok, "z": (np.array([9]), np.ones((1,), np.float32))})
                with pytest.raises(InvalidArgument, match="out= for 'z'"):
                    await sess.push_pull({"x": ok, "y": ok, "z": ok}, out={"z": np.empty(3, np.float32)})
                with pytest.raises(InvalidArgument, match="share memory"):
                    whole = np.empty(4, np.float32)
                    await sess.push_pull({"x": ok, "y": ok, "z": ok}, out={"y": whole, "z": whole})
                with pytest.raises(InvalidArgument, match="not pushed: w"):
                    await sess.push_pull({"x": ok}, out={"w": np.empty(4, np.float32)})
                for bad in (0, 2.0, True):
                    with pytest.raises(InvalidArgument, match="groups must be an int >= 1"):
                        await sess.push_pull({"x": ok}, groups=bad)  # type: ignore[arg-type]
                for bad in (0, -1.0, float("nan"), "1"):
                    with pytest.raises(InvalidArgument, match="timeout must be > 0"):
                        await sess.push_pull({"x": ok}, timeout=bad)  # type: ignore[arg-type]
                values = await sess.pull(["x", "y", "z"])
                for n in "xyz":
                    np.testing.assert_array_equal(values[n], np.zeros(4, np.float32))

    arun(main())


class _Fakes:
    """``push_pull``'s two transfers replaced by ones that note what happens (``events``) and wait
    to be let go (``gate(name).set()``), or raise what ``fail[name]`` holds; a group a variable."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, address: str):
        self.events: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.fail: dict[str, BaseException] = {}
        monkeypatch.setattr(pp, "_push", self._push)
        monkeypatch.setattr(pp, "_pull", self._pull)
        monkeypatch.setattr(pp, "checked_grads", dict)
        monkeypatch.setattr(pp, "GROUP_BYTES", 1)

        class Port:
            timeout = 10.0

            async def cluster(self) -> ClusterSpec:
                return ClusterSpec({"ps": [address]})

        self.port = Port

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    async def _wait(self, what: str) -> None:
        self.events.append(what)
        await self.gate(what).wait()
        if what in self.fail:
            raise self.fail[what]

    async def _push(self, _sess: Any, grads: dict, *_: Any) -> dict[str, Any]:
        name = "".join(info.name for info in grads)
        await self._wait(f"push {name}")
        self.events.append(f"pushed {name}")
        return {"step": 7, "stale": False, "replicas": [name]}

    async def _pull(self, _sess: Any, group: list, *_: Any) -> dict[str, Any]:
        await self._wait(f"pull {''.join(info.name for info in group)}")
        return {info.name: info.name for info in group}


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize("window", [1, 2, "local"])
def test_pushes_go_in_turn_each_pull_beside_later_pushes(monkeypatch: pytest.MonkeyPatch, window: int | str):
    """The schedule alone, with the two transfers replaced by ones that wait to be let go: at most
    ``WINDOW`` pushes out at once, the next one starting as the earliest is answered, and each
    group pulled once its own push is answered, beside the later pushes. Shards on this host
    take the model as one group: a push, then a pull."""
    fakes = _Fakes(monkeypatch, "127.0.0.1:2222" if window == "local" else "10.0.0.1:2222")
    events, gate, Port = fakes.events, fakes.gate, fakes.port
    monkeypatch.setattr(pp, "WINDOW", 1 if window == "local" else window)

    async def main() -> None:
        infos = [_Info(n, 1) for n in ("a", "b", "c", "d")]
        grads: dict[Any, Any] = dict.fromkeys(infos)
        call = asyncio.ensure_future(pp.push_pull(Port(), grads, None, None, None, None))  # type: ignore[arg-type]

        async def settle() -> list[str]:
            await _settle()
            new = sorted(events)
            events.clear()
            return new

        if window == "local":
            assert await settle() == ["push abcd"]
            gate("push abcd").set()
            assert await settle() == ["pull abcd", "pushed abcd"]
            gate("pull abcd").set()
            assert await asyncio.wait_for(call, 5) == {n: n for n in "abcd"}
            return
        assert isinstance(window, int)
        out = ["push a", "push b"][:window]
        assert await settle() == out  # the rest wait for a's push to be answered
        gate("push a").set()
        assert await settle() == sorted(["pushed a", "pull a", f"push {'abc'[window]}"])
        gate("pull a").set()
        assert await settle() == []  # a pull's end lets nothing go: pushes wait only for pushes
        for name in "bcd":
            gate(f"push {name}").set()
            gate(f"pull {name}").set()
        assert await asyncio.wait_for(call, 5) == {n: n for n in "abcd"}
        assert events.index("pull d") > events.index("pushed d")

    arun(main())


def test_a_failed_group_stops_the_rest_and_what_was_answered_stands(monkeypatch: pytest.MonkeyPatch):
    """A refused push: the groups waiting for its answer send nothing. A pull that fails after
    its push was answered: the answer is kept (the shards took that step). A pull that hangs:
    the call ends at its deadline, the hung pull cancelled."""
    fakes = _Fakes(monkeypatch, "10.0.0.1:2222")
    monkeypatch.setattr(pp, "WINDOW", 1)
    grads: dict[Any, Any] = dict.fromkeys(_Info(n, 1) for n in "abc")

    async def main() -> None:
        fakes.fail["push a"] = InvalidArgument("refused")
        fakes.gate("push a").set()
        answered: list[dict[str, Any]] = []
        with pytest.raises(InvalidArgument, match="refused"):
            await pp.push_pull(fakes.port(), grads, None, None, None, None, None, answered)  # type: ignore[arg-type]
        assert fakes.events == ["push a"] and answered == []  # b and c never went
        fakes.events.clear()
        fakes.fail = {"pull a": Unavailable("ps:0 is gone")}
        for g in ("push a", "pull a", "push b"):
            fakes.gate(g).set()
        with pytest.raises(Unavailable) as raised:
            await pp.push_pull(fakes.port(), grads, None, None, None, None, None, answered)  # type: ignore[arg-type]
        assert {"step": 7, "stale": False, "replicas": ["a"]} in answered and raised.value.details["pushed"] is False
        one: dict[Any, Any] = dict.fromkeys([_Info("a", 1)])
        with pytest.raises(Unavailable) as raised:  # every push answered, the read-back lost: the step was taken
            await pp.push_pull(fakes.port(), one, None, None, None, None)  # type: ignore[arg-type]
        assert raised.value.details["pushed"] is True
        fakes.events.clear()
        fakes.fail, fakes.gates = {}, {"push a": asyncio.Event(), "push b": asyncio.Event()}
        fakes.gate("push a").set()
        fakes.gate("push b").set()  # the pulls, and c's push, never come: the deadline does
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(DeadlineExceeded, match="within twice its timeout") as raised:
            await pp.push_pull(fakes.port(), grads, None, 0.3, None, None)  # type: ignore[arg-type]
        assert asyncio.get_running_loop().time() - t0 < 2.0 and raised.value.details["pushed"] is False

    arun(main())


def test_the_ps_strategy_reads_back_with_its_push_and_pulls_only_when_it_has_nothing(local):
    """A synchronous ``apply`` reads the parameters back with its push: the next ``params`` returns
    them without a pull, once; a step that leaves a parameter out, and a recovery, leave ``params``
    to pull."""
    sess, strategy = local_ps_strategy(sync=True)
    pulls: list[list[str]] = []
    pull = sess.pull

    def counted(names: list[str], **kw: Any) -> dict[str, Any]:
        pulls.append(list(names))
        return pull(names, **kw)

    sess.pull = counted  # type: ignore[method-assign]
    try:
        strategy.create({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}, zf.optim.SGD(1.0))
        assert strategy.params()["a"].tolist() == [0, 0, 0] and len(pulls) == 1
        for step in (1, 2):
            strategy.apply({"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)})
            got = strategy.params()
            assert got["a"].tolist() == [-step] * 3 and got["b"].tolist() == [-step] * 2
        assert len(pulls) == 1  # both read back by their apply
        assert strategy.params()["a"].tolist() == [-2] * 3 and len(pulls) == 2  # read back once: now a pull
        strategy.apply({"a": np.ones(3, np.float32)})  # b left out: params pulls both
        assert strategy.params()["b"].tolist() == [-2] * 2 and len(pulls) == 3
        strategy.apply({"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)})
        push_pull = sess.push_pull

        def lost(*_a: Any, **_kw: Any) -> dict[str, Any]:
            raise Unavailable("ps:0 is gone")

        sess.push_pull = lost  # type: ignore[method-assign]
        with pytest.raises(Unavailable, match="no checkpoint"):  # nothing to recover from: the recovery gives up
            strategy.apply({"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)})
        assert strategy.params()["a"].tolist() == [-4] * 3 and len(pulls) == 4  # the failed step read nothing back

        def read_back_lost(grads: dict[str, Any], **kw: Any) -> dict[str, Any]:
            sess.push(grads, learning_rate=kw.get("learning_rate"))
            raise Unavailable("ps:0: the read-back was lost", pushed=True)

        sess.push_pull = read_back_lost  # type: ignore[method-assign]
        assert strategy.apply({"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)}) == 5  # taken: counted
        sess.push_pull = push_pull  # type: ignore[method-assign]
        assert strategy.params()["a"].tolist() == [-5] * 3 and len(pulls) == 5  # and read by a pull
    finally:
        sess.pull = pull  # type: ignore[method-assign]

