"""The catalog: where each variable's parts are placed, and what a redeclaration may change."""

from __future__ import annotations


import pytest

from zmqflow.errors import InvalidArgument, NotFound, ResourceExhausted, VariableConflict
from zmqflow.state import catalog
from zmqflow.state.catalog import MAX_SPEC_BYTES, Catalog
from zmqflow.state.partition import row_splits


def _declare(cat: Catalog, name: str, parts: int = 1, nbytes: int = 100, **kw):
    rows = row_splits(parts * 2, parts)
    return cat.declare(name, [parts * 2, 4], "float32", [list(r) for r in rows], [nbytes] * parts, **kw)


def _tasks(record) -> list[str]:
    return [p["task"] for p in record["parts"]]


def test_catalog_round_robin_in_declaration_order_with_partitioned_variables():
    cat = Catalog(["ps:0", "ps:1", "ps:2"])
    assert _tasks(_declare(cat, "a")) == ["ps:0"]
    assert _tasks(_declare(cat, "b", parts=2)) == ["ps:1", "ps:2"]
    assert _tasks(_declare(cat, "c")) == ["ps:0"]
    assert _tasks(_declare(cat, "d", parts=4)) == ["ps:1", "ps:2", "ps:0", "ps:1"]
    assert _tasks(_declare(cat, "e")) == ["ps:2"]
    rec = cat.lookup("d")
    assert [p["rows"] for p in rec["parts"]] == [[0, 2], [2, 4], [4, 6], [6, 8]]


def test_catalog_greedy_picks_fewest_bytes():
    cat = Catalog(["ps:0", "ps:1", "ps:2"])
    assert _tasks(_declare(cat, "big", nbytes=1000, policy="greedy")) == ["ps:0"]
    assert _tasks(_declare(cat, "mid", nbytes=500, policy="greedy")) == ["ps:1"]
    assert _tasks(_declare(cat, "small", nbytes=10, policy="greedy")) == ["ps:2"]
    assert _tasks(_declare(cat, "next", nbytes=600, policy="greedy")) == ["ps:2"]  # 10 < 500 < 1000
    # each part is placed in turn: ps:1 (500 -> 800), then ps:2 (610 < 800)
    assert _tasks(_declare(cat, "parts", parts=2, nbytes=300, policy="greedy")) == ["ps:1", "ps:2"]
    assert cat.bytes == {"ps:0": 1000, "ps:1": 800, "ps:2": 910}


def test_catalog_greedy_ties_go_to_the_first_shard():
    cat = Catalog(["ps:0", "ps:1"])
    assert _tasks(_declare(cat, "a", nbytes=0, policy="greedy")) == ["ps:0"]
    assert _tasks(_declare(cat, "b", nbytes=5, policy="greedy")) == ["ps:0"]
    assert _tasks(_declare(cat, "c", nbytes=5, policy="greedy")) == ["ps:1"]


def test_catalog_device_pin():
    cat = Catalog(["ps:0", "ps:1"])
    assert _tasks(_declare(cat, "pinned", parts=2, device="ps:1", nbytes=400)) == ["ps:1", "ps:1"]
    assert cat.bytes["ps:1"] == 800
    # pinned bytes count for greedy placement
    assert _tasks(_declare(cat, "g", nbytes=10, policy="greedy")) == ["ps:0"]


def test_catalog_redeclaration():
    cat = Catalog(["ps:0", "ps:1"])
    first = _declare(cat, "w", parts=2, optimizer={"kind": "sgd"})
    again = _declare(cat, "w", parts=2)
    assert again is first
    assert first["optimizer"] == {"kind": "sgd"}
    # an identical redeclaration does not consume a round-robin turn
    assert _tasks(_declare(cat, "x")) == ["ps:0"]
    # tuples and lists describe the same rows
    assert cat.declare("w", (4, 4), "float32", [(0, 2), (2, 4)], [1, 1]) is first


@pytest.mark.parametrize(
    "shape, dtype, rows, needles",
    [
        ([5, 4], "float32", [[0, 5]], ["[4, 4]", "[5, 4]"]),
        ([4, 4], "float64", [[0, 4]], ["float32", "float64"]),
        ([4, 4], "float32", [[0, 2], [2, 4]], ["1 part(s)", "2 part(s)", "[[0, 4]]", "[[0, 2], [2, 4]]"]),
    ],
)
def test_catalog_conflicting_redeclaration_names_both(shape, dtype, rows, needles):
    cat = Catalog(["ps:0"])
    rec = cat.declare("w", [4, 4], "float32", [[0, 4]], [64])
    with pytest.raises(VariableConflict) as info:
        cat.declare("w", shape, dtype, rows, [1] * len(rows))
    msg = str(info.value)
    assert "'w'" in msg
    for needle in needles:
        assert needle in msg, msg
    assert cat.lookup("w") is rec and rec["shape"] == [4, 4] and cat.bytes == {"ps:0": 64}


def test_catalog_ready_lookup_uninitialized():
    cat = Catalog(["ps:0"])
    _declare(cat, "a")
    _declare(cat, "b")
    assert cat.uninitialized(["a", "b", "ghost"]) == ["a", "b", "ghost"]
    rec = cat.mark_ready("a")
    assert rec["ready"] is True and cat.ready("a") and not cat.ready("b")
    assert cat.uninitialized(["a", "b", "ghost"]) == ["b", "ghost"]
    with pytest.raises(NotFound, match="'ghost'"):
        cat.lookup("ghost")
    with pytest.raises(NotFound, match="'ghost'"):
        cat.mark_ready("ghost")


def test_catalog_bad_arguments():
    with pytest.raises(InvalidArgument):
        Catalog([])
    cat = Catalog(["ps:0"])
    with pytest.raises(InvalidArgument):
        cat.declare("", [2], "float32", [[0, 2]], [8])
    with pytest.raises(InvalidArgument, match="2 part row ranges but 1"):
        cat.declare("w", [2], "float32", [[0, 1], [1, 2]], [8])
    with pytest.raises(InvalidArgument):
        cat.declare("w", [2], "float32", [], [])
    with pytest.raises(InvalidArgument, match="'random'"):
        cat.declare("w", [2], "float32", [[0, 2]], [8], policy="random")
    assert cat.records == {} and cat.bytes == {"ps:0": 0}


def test_what_a_record_keeps_is_bounded_by_parts_and_by_spec_bytes(monkeypatch):
    """Records are kept for good: beside the count of names, the parts of all records and the
    size of each spec a client hands over are bounded, and a refusal records nothing."""
    cat = Catalog(["ps:0", "ps:1"])
    big = {"kind": "constant", "value": 0.0, "note": "x" * MAX_SPEC_BYTES}
    for what in ("optimizer", "initializer", "table"):
        with pytest.raises(InvalidArgument, match=rf"'w': its {what} spec takes \d+ bytes, over the limit of 4096"):
            cat.declare("w", [2], "float32", [[0, 2]], [8], **{what: big})
    with pytest.raises(InvalidArgument, match="'w': its initializer spec must be plain data"):
        cat.declare("w", [2], "float32", [[0, 2]], [8], initializer={"kind": "constant", "value": object()})
    assert cat.records == {} and cat.parts == 0
    monkeypatch.setattr(catalog, "MAX_CATALOG_PARTS", 5)
    _declare(cat, "a", parts=3)
    with pytest.raises(ResourceExhausted, match=r"'b': its 3 parts would bring the catalog to 6 parts, over its limit"):
        _declare(cat, "b", parts=3)
    _declare(cat, "a", parts=3)  # an existing record is still found
    _declare(cat, "c", parts=2)
    assert set(cat.records) == {"a", "c"} and cat.parts == 5 and cat.bytes == {"ps:0": 300, "ps:1": 200}


@pytest.mark.parametrize("alias", ["/job:ps/task:0", "/job:ps/replica:0/task:0", "/job:ps/task:0/device:CPU:0",
                                   " ps:0 "])
def test_a_device_alias_is_the_same_shard_and_its_budget(alias):
    """Aliases are stored as 'job:index', so they count against that shard's budget and a sweep
    that finds a shard's parts by task name finds them."""
    from zmqflow.cluster import ClusterSpec
    from zmqflow.server.services.catalog import CatalogService
    from zmqflow.state.limits import StateLimits

    spec = ClusterSpec({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    cat = CatalogService(spec, StateLimits(max_shard_bytes=1000)).catalog
    assert _tasks(cat.declare("a", [200], "float32", [[0, 200]], [800], device="ps:0")) == ["ps:0"]
    with pytest.raises(ResourceExhausted, match="shard ps:0 to 1600 bytes"):
        cat.declare("b", [200], "float32", [[0, 200]], [800], device=alias)
    assert cat.held == {"ps:0": 800} and "b" not in cat.records
    assert _tasks(cat.declare("c", [50], "float32", [[0, 50]], [200], device=alias)) == ["ps:0"]


def test_a_device_that_is_no_task_is_refused_by_name():
    from zmqflow.cluster import ClusterSpec
    from zmqflow.rpc import CallContext
    from zmqflow.server.services.catalog import CatalogService
    from zmqflow.wire.requests import cluster as rq

    svc = CatalogService(ClusterSpec({"ps": ["127.0.0.1:1"]}))
    ctx = CallContext("catalog", "declare", b"peer", "worker:0", None)
    for bad in ["ps", "/job:ps", "gpu:0:1", "/task:0", 7]:
        with pytest.raises(InvalidArgument, match=f"device {bad!r} is not a task"):
            svc.catalog.declare("v", [2], "float32", [[0, 2]], [8], device=bad)
    req = rq.Declare(name="v", shape=[2], dtype="float32", part_rows=[[0, 2]], part_bytes=[8], device="ps:1/x")
    with pytest.raises(InvalidArgument, match="device 'ps:1/x' is not a task"):
        svc.declare(ctx, req)
    req = rq.Declare(name="v", shape=[2], dtype="float32", part_rows=[[0, 2]], part_bytes=[8], device="/job:ps/task:1")
    with pytest.raises(InvalidArgument, match="device 'ps:1' is not a task of the cluster"):
        svc.declare(ctx, req)
    assert svc.catalog.records == {} and svc.catalog.held == {}


def test_catalog_redeclaring_with_another_optimizer_conflicts_and_naming_none_attaches():
    """Get-or-create: a declaration that names no optimizer attaches to the variable as it is;
    one that names another (or a different synchronous setup) names both, where it used to
    attach and have its pushes run the first one's optimizer."""
    cat = Catalog(["ps:0"])
    sync = {"kind": "sync_replicas", "optimizer": {"kind": "sgd", "learning_rate": 0.1}, "replicas_to_aggregate": 2}
    first = _declare(cat, "w", optimizer=sync)
    assert _declare(cat, "w") is first and _declare(cat, "w", optimizer=dict(sync)) is first
    for other in ({"kind": "sgd", "learning_rate": 0.1}, {**sync, "replicas_to_aggregate": 3}):
        with pytest.raises(VariableConflict, match="variable 'w' exists with optimizer .*; declared with"):
            _declare(cat, "w", optimizer=other)
    _declare(cat, "plain")
    with pytest.raises(VariableConflict, match=r"'plain' exists with optimizer none \(a plain add\)"):
        _declare(cat, "plain", optimizer={"kind": "sgd", "learning_rate": 0.1})
    _declare(cat, "adam", optimizer={"kind": "adam"})
    assert _declare(cat, "adam", optimizer={"kind": "adam", "learning_rate": 0.001})  # the same, spelled out
    assert cat.lookup("plain")["optimizer"] is None


@pytest.mark.parametrize("rows", [[[0, 2], [0, 2]], [[0, 2], [3, 6]], [[0, 4]], [[2, 6], [0, 2]], [[0, 4], [2, 6]],
                                  [[0, 6], [6, 7]]])
def test_catalog_refuses_part_rows_that_do_not_tile_the_variable(rows):
    """Parts must cover [0, dim) in order: a gap would be read as memory no shard wrote, an
    overlap as two shards' rows for one row. Nothing is recorded."""
    cat = Catalog(["ps:0", "ps:1"])
    with pytest.raises(InvalidArgument, match=r"variable 'g': part rows .* (do not cover \[0, 6\)|end at row)"):
        cat.declare("g", [6, 2], "float32", rows, [16] * len(rows))
    assert cat.records == {} and cat.parts == 0 and cat.held == {}
    assert cat.declare("g", [6, 2], "float32", [[0, 2], [2, 2], [2, 6]], [16, 0, 32])  # an empty part is a part


def test_catalog_refuses_an_optimizer_on_a_variable_that_is_not_floating_point():
    cat = Catalog(["ps:0"])
    with pytest.raises(InvalidArgument, match="variable 'i' is int32: the sgd optimizer updates floating-point"):
        cat.declare("i", [4], "int32", [[0, 4]], [16], optimizer={"kind": "sgd"})
    assert cat.records == {}
    assert cat.declare("i", [4], "int32", [[0, 4]], [16])
