"""Declarations that race or fail half-way: one declarer at a time creates a record's parts (it
holds the catalog's claim), a declaration by shape alone never makes zeros of a variable declared
with a value, and a declaration a shard refuses is undone (parts and record), so the name is free."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import zmqflow as zf
from zmqflow.client.session import AsyncSession
from zmqflow.cluster import ClusterSpec
from zmqflow.errors import DeadlineExceeded, InvalidArgument, PermissionDenied, ResourceExhausted, Unavailable
from zmqflow.rpc import CallContext
from zmqflow.server.limits import ServerLimits
from zmqflow.server.services.catalog import CatalogService
from zmqflow.server.services.ps import PsService
from zmqflow.state.catalog import Catalog
from zmqflow.testing import local_cluster, make_spec, wait_until
from zmqflow.transport.curve import Keys, generate
from zmqflow.wire.requests import cluster as crq
from zmqflow.wire.requests import ps as rq

from .conftest import arun

VALUE = np.arange(1, 9, dtype=np.float32)
TWO = zf.fixed_size_partitioner(2)


def _ctx(source: str, op: str = "declare") -> CallContext:
    return CallContext("catalog", op, source.encode(), source, None)


def _in_threads(*fns: Callable[[], Any], timeout: float = 30.0) -> list[Any]:
    """Each function's result (or what it raised), all started at once from a barrier."""
    barrier = threading.Barrier(len(fns))
    out: list[Any] = [None] * len(fns)

    def run(i: int, fn: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            out[i] = fn()
        except Exception as exc:  # handed to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a declaration did not return"
    return out


def _stop(*things: Any) -> None:
    for thing in things:
        if isinstance(thing, zf.Session):
            thing.close()
        else:
            thing.stop()


# the catalog's claim, sans-IO ----------------------------------------------------------------


def test_one_declarer_at_a_time_holds_the_claim_and_only_one_that_can_build_takes_it_over():
    cat = Catalog(["ps:0", "ps:1"])
    cat.declare("w", [4], "float32", [[0, 2], [2, 4]], [8, 8])  # made with a value: no initializer
    first = cat.claim("w", "chief", 0.0, 10.0, creator=True, has_value=True)
    assert first is not None and first.owner == "chief" and len(first.token) >= 32
    assert cat.claim("w", "worker:0", 5.0, 10.0, has_value=True) is None  # held, and the lease runs
    assert cat.claim("w", "worker:0", 11.0, 10.0) is None  # lapsed, but nothing to build the parts from
    again = cat.claim("w", "chief", 6.0, 10.0, has_value=True)  # the holder's retry renews its lease
    assert again is first and first.until == 16.0
    taken = cat.claim("w", "worker:0", 17.0, 10.0, has_value=True)
    assert taken is not None and taken.owner == "worker:0" and taken.token != first.token
    assert not first.overwrite and taken.overwrite  # the chief may have made parts of its own value
    with pytest.raises(PermissionDenied, match=r"catalog.mark_ready of 'w': .* held by 'worker:0'"):
        cat.mark_ready("w", first.token, "chief")
    with pytest.raises(PermissionDenied):  # the token under another caller's name is of no use
        cat.mark_ready("w", taken.token, "chief")
    assert cat.mark_ready("w", taken.token, "worker:0")["ready"] and cat.pending == {}
    assert cat.claim("w", "worker:1", 18.0, 10.0, has_value=True) is None  # ready: nothing to claim

    cat.declare("i", [4], "float32", [[0, 4]], [16], initializer={"kind": "constant", "value": 2.0})
    assert cat.claim("i", "chief", 0.0, 1.0, creator=True) is not None
    later = cat.claim("i", "worker:0", 2.0, 1.0)  # an initializer in the record: anyone may build
    assert later is not None and later.owner == "worker:0" and not later.overwrite  # the same parts


def test_a_value_takes_over_a_record_declared_by_shape_alone_and_writes_over_what_it_finds():
    cat = Catalog(["ps:0"])
    cat.declare("w", [4], "float32", [[0, 4]], [16], initializer={"kind": "zeros"})
    shape = cat.claim("w", "worker:0", 0.0, 10.0, creator=True, defaulted=True)
    assert shape is not None and not shape.overwrite
    assert cat.claim("w", "worker:1", 1.0, 10.0) is None  # another by shape waits
    value = cat.claim("w", "chief", 1.0, 10.0, has_value=True)
    assert value is not None and value.owner == "chief" and value.overwrite
    assert cat.lookup("w")["initializer"] is None  # its parts come from a value now
    assert cat.claim("w", "worker:1", 12.0, 10.0) is None  # so none by shape may ever take them
    with pytest.raises(PermissionDenied):
        cat.mark_ready("w", shape.token, "worker:0")
    cat.abandon("w", value.token, "chief", keep=True)  # a shard was out: the next holder writes over too
    assert cat.claim("w", "worker:2", 13.0, 10.0, has_value=True).overwrite


def test_abandoning_gives_back_what_the_record_counted_and_only_its_holder_may():
    cat = Catalog(["ps:0", "ps:1"])
    cat.declare("keep", [4, 2], "float32", [[0, 4]], [32], optimizer={"kind": "adam"})
    before = (dict(cat.bytes), dict(cat.held), cat.parts)
    cat.declare("w", [4, 2], "float32", [[0, 2], [2, 4]], [16, 16], optimizer={"kind": "adam"})
    held = cat.claim("w", "chief", 0.0, 10.0, creator=True, has_value=True)
    with pytest.raises(PermissionDenied):
        cat.abandon("w", held.token, "worker:0")
    assert cat.abandon("w", held.token, "chief", keep=True) is False and "w" in cat.records
    assert cat.holder("w") is None
    held = cat.claim("w", "chief", 1.0, 10.0, has_value=True)
    assert cat.abandon("w", held.token, "chief") is True
    assert "w" not in cat.records and (dict(cat.bytes), dict(cat.held), cat.parts) == before
    cat.mark_ready("keep")
    with pytest.raises(InvalidArgument, match="abandon of 'keep': the variable is ready"):
        cat.abandon("keep", "x", "chief")


def test_a_first_declaration_with_neither_a_value_nor_an_initializer_is_refused():
    svc = CatalogService(ClusterSpec({"ps": ["127.0.0.1:1"]}))
    req = crq.Declare(name="v", shape=[2], dtype="float32", part_rows=[[0, 2]], part_bytes=[8])
    with pytest.raises(InvalidArgument, match="'v': a first declaration names an initializer or holds"):
        svc.declare(_ctx("worker:0"), req)
    assert svc.catalog.records == {}
    reply = svc.declare(_ctx("worker:0"), crq.Declare(name="v", shape=[2], dtype="float32", part_rows=[[0, 2]],
                                                      part_bytes=[8], has_value=True))
    assert reply["claim"] and reply["ready"] is False and reply["overwrite"] is False


def test_a_shard_drops_only_the_parts_the_owner_made():
    ps = PsService()
    alice, bob = CallContext("ps", "create", b"a", "alice", None), CallContext("ps", "create", b"b", "bob", None)
    catalog = CallContext("ps", "drop", b"c", "ps:0", None)  # the catalog's task, for the declarer named
    assert ps.create(alice, name="w", part=0, shape=[4], rows=[0, 4], dtype="float32") is True
    assert ps.store.held_bytes() == 16
    assert ps.drop(catalog, rq.Drop(items=[rq.Pair("w", 0)], owner="bob")) == [] and ("w", 0) in ps.store.parts
    assert ps.drop(catalog, rq.Drop(items=[rq.Pair("w", 0), rq.Pair("ghost", 3)], owner="alice")) == [["w", 0]]
    assert ps.store.parts == {} and ps.store.held_bytes() == 0
    # the last to declare a part owns it: one that lost its claim cannot drop what another took on
    ps.create(alice, name="w", part=0, shape=[4], rows=[0, 4], dtype="float32")
    assert ps.create(bob, name="w", part=0, shape=[4], rows=[0, 4], dtype="float32") is False
    assert ps.drop(catalog, rq.Drop(items=[rq.Pair("w", 0)], owner="alice")) == [] and ("w", 0) in ps.store.parts


# real servers --------------------------------------------------------------------------------


def test_with_keys_the_claim_is_its_keys_and_its_token_is_of_no_use_under_another(tmp_path):
    spec = make_spec({"ps": 1, "worker": 2}, "tcp")
    keys = str(tmp_path / "keys")
    generate(keys, spec)

    async def scenario() -> None:
        async with local_cluster(spec, timeout=10, keys=keys) as servers:
            target = servers["ps:0"].target
            async with AsyncSession(target, keys=Keys.load(keys, "worker:0")) as holder, \
                    AsyncSession(target, keys=Keys.load(keys, "worker:1")) as task, \
                    AsyncSession(target, keys=Keys.load(keys)) as client:
                req = crq.Declare(name="w", shape=[4], dtype="float32", part_rows=[[0, 4]], part_bytes=[16],
                                  has_value=True)
                claim = (await holder.call_catalog("declare", req))["claim"]
                assert await holder.call("ps", "create", rq.Create(name="w", part=0, shape=[4], rows=[0, 4],
                                                                   dtype="float32"), task="ps:0") is True
                for other in (task, client):
                    with pytest.raises(PermissionDenied, match="held by 'worker:0'"):
                        await other.call_catalog("mark_ready", crq.MarkReady(name="w", claim=claim))
                    with pytest.raises(PermissionDenied, match="held by 'worker:0'"):
                        await other.call_catalog("abandon", crq.Abandon(name="w", claim=claim))
                # only the catalog's task drops parts: a client key cannot, even naming the declarer
                with pytest.raises(PermissionDenied, match="ps.drop needs a task key"):
                    await client.call("ps", "drop", rq.Drop(items=[rq.Pair("w", 0)], owner="worker:0"), task="ps:0")
                assert [v["name"] for v in await client.call("ps", "variables", task="ps:0")] == ["w"]
                assert await holder.call_catalog("abandon", crq.Abandon(name="w", claim=claim)) is True
                assert servers["ps:0"].service("catalog").catalog.records == {}
                assert await client.call("ps", "variables", task="ps:0") == []  # the catalog dropped its part

    arun(scenario())



@contextlib.contextmanager
def _half_made() -> Iterator[tuple[zf.Session, Callable[[float], zf.Session]]]:
    """(the chief, a maker of more sessions) once the chief's declaration of ``w`` made part 0 of
    VALUE and failed on ps:1 (down), and ps:1 is back, empty; everything is stopped after."""
    spec = make_spec({"ps": 2, "worker": 1}, "tcp")
    servers = [zf.Server(spec, "ps:0"), zf.Server(spec, "ps:1")]
    worker = zf.Server(spec, "worker:0")
    sessions: list[zf.Session] = []

    def session(timeout: float) -> zf.Session:
        sessions.append(zf.Session(worker.target, timeout=timeout))
        return sessions[-1]

    try:
        chief = session(2.0)
        chief.wait_for_cluster(10)
        servers[1].stop()
        with pytest.raises((Unavailable, DeadlineExceeded), match="ps:1"):
            chief.variable("w", VALUE, partitioner=TWO)
        assert [v["name"] for v in chief.call("ps", "variables", task="ps:0")] == ["w"]  # part 0 holds VALUE[:4]
        servers[1] = zf.Server(spec, "ps:1")  # back, empty
        yield chief, session
    finally:
        _stop(*sessions, worker, *servers)


def test_an_attach_by_shape_never_makes_zeros_of_a_half_made_variable():
    """The chief's declaration makes part 0 and fails on ps:1 (down). A worker attaching by shape
    used to create part 1 from no value (zeros) and make the variable ready; the chief's retry
    then read [1 2 3 4 0 0 0 0]. Now the attach waits, and the chief's retry finishes it."""
    with _half_made() as (chief, session):
        attach = session(1.5)
        with pytest.raises(DeadlineExceeded, match=r"'w' did not become ready within [\d.]+s: .* with its value"):
            attach.variable("w", shape=[8], partitioner=TWO)
        assert attach.call("ps", "variables", task="ps:1") == []  # no zeros made
        waiting = session(10.0)
        got, retried = _in_threads(lambda: waiting.variable("w", shape=[8], partitioner=TWO).read(),
                                   lambda: chief.variable("w", VALUE, partitioner=TWO).read())
        np.testing.assert_array_equal(retried, VALUE)
        np.testing.assert_array_equal(got, VALUE)


def test_a_value_that_takes_a_half_made_record_over_writes_over_the_parts_it_finds():
    """The chief's declaration makes part 0 of its value and fails on ps:1 (down), giving the claim
    up. Another session, with another value, used to make part 1 of its own and read a mix of both
    values; now it writes its value over part 0 too."""
    with _half_made() as (chief, session):
        other = session(10.0)
        np.testing.assert_array_equal(other.variable("w", -VALUE, partitioner=TWO).read(), -VALUE)
        np.testing.assert_array_equal(chief.variable("w", VALUE, partitioner=TWO).read(), -VALUE)  # ready: attached


def test_declarations_at_once_all_read_the_value_of_the_one_that_has_it():
    """Per variable, a session with the value and two by shape alone declare at once. ps:1 is
    held until the one with the value holds the claim, so each of the others has come first or
    been waiting: whichever order they came in, every part is the value."""
    spec = make_spec({"ps": 2, "worker": 1}, "tcp")
    servers = [zf.Server(spec, "ps:0"), zf.Server(spec, "ps:1")]
    worker = zf.Server(spec, "worker:0")
    catalog = servers[0].async_server.service("catalog").catalog
    chief, a, b = (zf.Session(worker.target, timeout=10.0) for _ in range(3))
    gate = threading.Event()
    try:
        chief.wait_for_cluster(10)
        for i in range(30):
            name = f"w{i}"
            gate.clear()
            held = threading.Event()
            servers[1].loop_thread.loop.call_soon_threadsafe(lambda: (held.set(), gate.wait(20)))
            assert held.wait(10)
            results: list[Any] = []
            runner = threading.Thread(target=lambda: results.extend(_in_threads(
                lambda: chief.variable(name, VALUE, partitioner=TWO),
                lambda: a.variable(name, shape=[8], partitioner=TWO),
                lambda: b.variable(name, shape=[8], partitioner=TWO))))
            runner.start()
            try:
                wait_until(lambda: (c := catalog.holder(name)) is not None and c.owner == chief.name, 10,
                           what=f"the session with the value holding the claim on {name}")
            finally:
                gate.set()
                runner.join(30)
            assert not runner.is_alive() and len(results) == 3
            for v in results:
                assert not isinstance(v, BaseException), v
                np.testing.assert_array_equal(v.read(), VALUE)
    finally:
        gate.set()
        _stop(chief, a, b, worker, *servers)


def test_a_lapsed_claim_passes_only_to_a_declarer_that_can_build_the_parts():
    """A declarer that got the claim and was gone: a declaration by shape alone waits and gives
    up at its deadline, making nothing, even past the lease; one with the value takes it over."""
    async def scenario() -> None:
        async with local_cluster({"ps": 2, "worker": 1}, timeout=10) as servers:
            target = servers["worker:0"].target
            async with AsyncSession(target) as gone, AsyncSession(target, timeout=1.5) as attach, \
                    AsyncSession(target, timeout=10) as late:
                req = crq.Declare(name="w", shape=[8], dtype="float32", part_rows=[[0, 4], [4, 8]],
                                  part_bytes=[16, 16], has_value=True)
                record = await gone.call_catalog("declare", req, timeout=0.5)  # a lease of 1 s, never used
                assert record["claim"] and not record["ready"]
                with pytest.raises(DeadlineExceeded, match="'w' did not become ready"):
                    await attach.variable("w", shape=[8], partitioner=TWO)
                for task in ("ps:0", "ps:1"):
                    assert await attach.call("ps", "variables", task=task) == []
                v = await late.variable("w", VALUE, partitioner=TWO)
                np.testing.assert_array_equal(await v.read(), VALUE)
                with pytest.raises(InvalidArgument, match="the variable is ready"):
                    await gone.call_catalog("abandon", crq.Abandon(name="w", claim=record["claim"]))

    arun(scenario())


def test_a_declaration_a_shard_refuses_is_undone_and_the_name_stays_free():
    """ps:1's own budget refuses part 1: the record used to stay not ready for good (the same
    declaration failing every time, any other one a VariableConflict) with part 0 held on ps:0."""
    spec = make_spec({"ps": 2, "worker": 1}, "tcp")
    servers = [zf.Server(spec, "ps:0"), zf.Server(spec, "ps:1", limits=ServerLimits(max_shard_bytes=1 << 20))]
    worker = zf.Server(spec, "worker:0")
    catalog = servers[0].async_server.service("catalog").catalog
    sess = zf.Session(worker.target, timeout=5.0)
    try:
        sess.wait_for_cluster(10)
        before = (dict(catalog.bytes), dict(catalog.held), catalog.parts)
        for _ in range(2):  # the same refusal every time, never a conflict with a variable nobody can use
            with pytest.raises(ResourceExhausted, match=r"emb \(part 1\).*over its limit"):
                sess.variable("emb", shape=[2, 1 << 19], partitioner=TWO)
            assert "emb" not in catalog.records and (dict(catalog.bytes), dict(catalog.held), catalog.parts) == before
            assert sess.call("ps", "variables", task="ps:0") == []  # part 0 went with it
        small = sess.variable("emb", shape=[2, 1 << 10], partitioner=TWO)
        np.testing.assert_array_equal(small.read(), np.zeros((2, 1 << 10), np.float32))
        assert sess.uninitialized(["emb"]) == []
        # an embedding table's parts the same way
        with pytest.raises(ResourceExhausted, match="over its limit"):
            sess.embedding("table", 1 << 17, 8, partitions=2)
        assert "table" not in catalog.records
        held = [v["name"] for t in ("ps:0", "ps:1") for v in sess.call("ps", "variables", task=t)]
        assert "table" not in held
        table = sess.embedding("table", 1 << 10, 8, partitions=2)
        assert table.lookup([1, 2]).shape == (2, 8)
    finally:
        _stop(sess, worker, *servers)
