"""The numpy open-addressing index, the pending-admission counts and the dynamic table built on
them, each checked against a plain dict model under random sequences of operations: repeats
within a batch, id 0, negative ids and the int64 extremes, growth, deletion and reuse. Every test
runs twice: with the index's C probe (where it was built) and with its numpy rounds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqflow import errors
from zmqflow.state.admission import Sightings
from zmqflow.state import hash_index
from zmqflow.state.hash_index import DELETED, EMPTY, HashIndex
from zmqflow.bench import embedding as embedding_bench
from zmqflow.state import init, optim, pages
from zmqflow.state.tables import MAX_CLOCK, HashTable

FAST = settings(max_examples=120, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

I64 = np.iinfo(np.int64)
SPECIAL = [0, 1, -1, 2, -2, I64.min, I64.max, I64.min + 1, I64.max - 1, 1 << 32, -(1 << 32)]
# ids that differ only in their top bits, or only in their bottom bits: the hash must spread both
SPECIAL += [k << 58 for k in range(-8, 8)] + [(1 << 62) + k for k in range(8)]
ids_st = st.one_of(st.sampled_from(SPECIAL), st.integers(-40, 40), st.integers(I64.min, I64.max))


@pytest.fixture(autouse=True, params=["c", "numpy"])
def probe(request: pytest.FixtureRequest) -> Iterator[str]:
    """The C probe, then the numpy rounds: both must give every answer of the dict model."""
    if request.param == "c" and hash_index._compiled is None:
        pytest.skip("the C probe (zmqflow/state/hash_probe.c) is not built here: the numpy rounds run alone")
    before = hash_index.use_compiled(request.param == "c")
    try:
        yield request.param
    finally:
        hash_index.use_compiled(before)


def batches(max_size: int = 24) -> Any:
    return st.lists(ids_st, max_size=max_size)


def check_invariants(index: HashIndex, keys: np.ndarray, model: dict[int, int]) -> None:
    ctrl = index.bytes
    assert index.live == len(model) == int(np.count_nonzero(ctrl >= 0x80))
    assert index.used == int(np.count_nonzero(ctrl != EMPTY)) and set(np.unique(ctrl)) <= {EMPTY, DELETED} | set(range(128, 256))
    assert index.used <= index.max_load * index.buckets
    assert sorted(model.values()) == index.values().tolist()
    assert {int(keys[h]) for h in index.values()} == set(model)


# the index --------------------------------------------------------------------------------------


@FAST
@given(st.lists(st.tuples(st.sampled_from(["insert", "find", "remove"]), batches()), max_size=30))
def test_index_behaves_like_a_dict(ops: list[tuple[str, list[int]]]) -> None:
    index = HashIndex(np.int32)
    keys = np.zeros(2, np.int64)
    model: dict[int, int] = {}
    free: list[int] = []
    top = 0
    for op, batch in ops:
        if op == "insert":
            new = list(dict.fromkeys(i for i in batch if i not in model))
            handles = []
            for _ in new:
                if free:
                    handles.append(free.pop())
                else:
                    handles.append(top)
                    top += 1
            if top > len(keys):  # the caller's key array grows: the index reads the new one
                grown = np.zeros(2 * top, np.int64)
                grown[: len(keys)] = keys
                keys = grown
            keys[handles] = new
            index.insert(np.array(new, np.int64), np.array(handles, np.int64), keys)
            model.update(zip(new, handles))
        elif op == "find":
            got = index.find(np.array(batch, np.int64), keys)
            assert got.dtype == np.int64 and got.tolist() == [model.get(i, -1) for i in batch]
        else:
            gone = list(dict.fromkeys(i for i in batch if i in model))
            handles = np.array([model.pop(i) for i in gone], np.int64)
            assert index.remove(handles, keys) == len(gone)
            free.extend(handles.tolist())
        check_invariants(index, keys, model)
    everything = list(model) + SPECIAL
    assert index.find(np.array(everything, np.int64), keys).tolist() == [model.get(i, -1) for i in everything]


def test_index_survives_heavy_churn_and_colliding_ids() -> None:
    """Ids sharing their home bucket, inserted and removed in waves: tombstones are reclaimed, the
    table does not grow without bound, and every answer stays right."""
    index = HashIndex(np.int32)
    size = 4096
    keys = np.zeros(size, np.int64)
    rng = np.random.default_rng(0)
    model: dict[int, int] = {}
    free = list(range(size))
    for wave in range(60):
        pool = np.concatenate([np.arange(-50, 50) << np.int64(56), rng.integers(I64.min, I64.max, 300)])
        new = [int(i) for i in np.unique(pool) if int(i) not in model][: len(free)]
        handles = [free.pop() for _ in new]
        keys[handles] = new
        index.insert(np.array(new, np.int64), np.array(handles, np.int64), keys)
        model.update(zip(new, handles))
        gone = [i for i in model if rng.random() < 0.7]
        index.remove(np.array([model[i] for i in gone], np.int64), keys)
        for i in gone:
            free.append(model.pop(i))
        probe = np.concatenate([np.array(list(model) + gone, np.int64), pool])
        assert index.find(probe, keys).tolist() == [model.get(int(i), -1) for i in probe]
    check_invariants(index, keys, model)
    assert index.buckets <= 8 * 1024  # churn rebuilt the table in place rather than growing it


@pytest.mark.parametrize("count", [3, 1000, 37_001])
def test_the_c_probe_and_the_numpy_rounds_lay_ids_out_alike(probe: str, count: int) -> None:
    """Each path reads what the other wrote (so the fallback can take over any index), at group
    counts sized to the ids (not powers of two), with groups full enough that probes run on."""
    if hash_index._compiled is None:
        pytest.skip("the C probe is not built here: there is one path only")
    rng = np.random.default_rng(count)
    keys = np.unique(np.concatenate([rng.integers(I64.min, I64.max, count), np.array(SPECIAL, np.int64)]))
    rng.shuffle(keys)
    handles = np.arange(len(keys), dtype=np.int64)
    index = HashIndex(np.int32, max_load=0.875)
    for part in np.array_split(np.arange(len(keys)), 7):  # grown by inserts, rebuilt on the way
        index.insert(keys[part], handles[part], keys)
    other = hash_index.use_compiled(probe != "c")  # read with the path that did not write
    try:
        assert index.find(keys, keys).tolist() == handles.tolist()
        absent = rng.integers(I64.min, I64.max, 500)
        absent = absent[~np.isin(absent, keys)]
        assert (index.find(absent, keys) == -1).all()
    finally:
        hash_index.use_compiled(other)


def test_index_rejects_a_bad_load_factor() -> None:
    with pytest.raises(ValueError, match="max_load"):
        HashIndex(np.int32, max_load=1.0)


# pending admission ------------------------------------------------------------------------------


@FAST
@given(st.lists(st.tuples(st.sampled_from(["sight", "sight", "discard", "prune"]), batches(), st.integers(1, 4)),
                max_size=30))
def test_sightings_behave_like_an_ordered_dict(ops: list[tuple[str, list[int], int]]) -> None:
    s = Sightings()
    model: dict[int, int] = {}  # dicts keep insertion order: first sighting first
    for op, batch, k in ops:
        uniq = list(dict.fromkeys(batch))
        arr = np.array(uniq, np.int64)
        if op == "sight":
            want = []
            for i in uniq:
                seen = model.get(i, 0) + 1
                want.append(seen >= k)
                if seen < k:
                    model[i] = seen
            assert s.sight(arr, k).tolist() == want
        elif op == "discard":
            s.discard(arr)
            for i in uniq:
                model.pop(i, None)
        else:
            keep = len(model) * k // 5
            assert s.prune(keep) == max(0, len(model) - keep)
            model = dict(list(model.items())[max(0, len(model) - keep):])
        ids, counts = s.items()
        assert list(zip(ids.tolist(), counts.tolist())) == list(model.items())
        assert len(s) == len(model) and s.get(arr).tolist() == [model.get(i, 0) for i in uniq]
        assert all((i in s) == (i in model) for i in uniq + SPECIAL[:4])
    assert "not an id" not in s


# the table ---------------------------------------------------------------------------------------


class TableModel:
    """The dynamic table's semantics with dicts: admission after ``min_frequency`` sightings in
    separate calls, pending ids capped (oldest first sighted forgotten), least recently used rows
    evicted past the capacity (rows used at the same tick in any order), eviction by age."""

    def __init__(self, capacity: int, min_frequency: int, max_pending: int, lr: float):
        self.capacity, self.min_frequency, self.max_pending, self.lr = capacity, min_frequency, max_pending, lr
        self.rows: dict[int, np.ndarray] = {}
        self.used: dict[int, int] = {}
        self.updated: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        self.tick = self.step = self.evicted = self.dropped = self.pruned = 0

    def evict_lru(self, count: int, table_ids: set[int]) -> None:
        """Drop ``count`` least recently used rows; which of a tie went is read from the table."""
        order = sorted(self.used.values())
        if not order:
            return
        kth = order[min(count, len(order)) - 1]
        must = [i for i, t in self.used.items() if t < kth]
        tie = [i for i, t in self.used.items() if t == kth]
        gone_tie = [i for i in tie if i not in table_ids]
        assert len(must) + len(gone_tie) == min(count, len(order)), "evicted rows were not the least recently used"
        for i in must + gone_tie:
            self.drop(i)

    def drop(self, i: int) -> None:
        del self.rows[i], self.used[i], self.updated[i]
        self.evicted += 1

    def create(self, new: list[int], table_ids: set[int]) -> None:
        excess = len(self.rows) + len(new) - self.capacity
        if excess > 0:
            self.evict_lru(excess, table_ids)
        for i in new[: self.capacity]:
            self.rows[i] = np.ones(2, np.float32)
            self.used[i], self.updated[i] = self.tick, self.step
            self.pending.pop(i, None)

    def lookup(self, ids: list[int], create: bool, table_ids: set[int]) -> np.ndarray:
        self.tick += 1
        if create:
            for i in ids:  # the batch's own rows are used now, before any is evicted to make room
                if i in self.rows:
                    self.used[i] = self.tick
            admitted = []
            for i in dict.fromkeys(ids):
                if i in self.rows:
                    continue
                seen = self.pending.get(i, 0) + 1
                if seen >= self.min_frequency:
                    admitted.append(i)
                else:
                    self.pending[i] = seen
            if admitted:
                self.create(admitted, table_ids)
            if len(self.pending) > self.max_pending:
                drop = len(self.pending) - self.max_pending * 3 // 4
                self.pending = dict(list(self.pending.items())[drop:])
                self.pruned += drop
        for i in ids:
            if i in self.rows:
                self.used[i] = self.tick
        return np.array([self.rows.get(i, np.zeros(2, np.float32)) for i in ids], np.float32).reshape(-1, 2)

    def push(self, ids: list[int]) -> int:
        self.tick += 1
        self.step += 1
        found = [i for i in ids if i in self.rows]
        for i in found:
            self.rows[i] = self.rows[i] - np.float32(self.lr)
            self.used[i], self.updated[i] = self.tick, self.step
        self.dropped += len(ids) - len(found)
        return len(found)


table_ops = st.tuples(st.sampled_from(["lookup", "lookup", "lookup", "peek", "push", "evict", "load"]),
                      st.lists(st.one_of(st.integers(-12, 12), st.sampled_from(SPECIAL)), max_size=12),
                      st.integers(0, 4))


@FAST
@given(st.integers(1, 10), st.integers(1, 3), st.integers(1, 8), st.lists(table_ops, max_size=40))
def test_table_behaves_like_the_dict_model(capacity: int, min_frequency: int, max_pending: int,
                                          ops: list[tuple[str, list[int], int]]) -> None:
    lr = 0.5
    table = HashTable(2, np.dtype("float32"), initializer=init.ones(),
                      optimizer=optim.SGD(lr), min_frequency=min_frequency, capacity=capacity,
                      max_pending=max_pending)
    model = TableModel(capacity, min_frequency, max_pending, lr)
    for op, ids, k in ops:
        arr = np.array(ids, np.int64)
        if op in ("lookup", "peek"):
            out = table.lookup(arr, create=op == "lookup")
            want = model.lookup(ids, op == "lookup", set(table.export()[0].tolist()))
            np.testing.assert_array_equal(out, want)
        elif op == "push":
            uniq = list(dict.fromkeys(ids))
            assert table.push(np.array(uniq, np.int64), np.ones((len(uniq), 2), np.float32)) == model.push(uniq)
        elif op == "evict":
            old = [i for i, s in model.updated.items() if s < model.step - k]
            assert table.evict(older_than_step=k) == len(old)
            for i in old:
                model.drop(i)
        else:
            uniq = list(dict.fromkeys(ids))
            rows = np.full((len(uniq), 2), 3.0, np.float32)
            kept = table.load(np.array(uniq, np.int64), rows, {}, None)
            new = [i for i in uniq if i not in model.rows]
            if new:
                model.create(new, set(table.export()[0].tolist()))
            assert kept == sum(i in model.rows for i in uniq)
            for i in uniq:
                if i in model.rows:  # loaded rows count as changed now (no ``changed`` given)
                    model.rows[i] = np.full(2, 3.0, np.float32)
                    model.updated[i] = model.step
        exported, values = table.export()
        assert exported.tolist() == sorted(model.rows)
        np.testing.assert_array_equal(values, np.array([model.rows[i] for i in sorted(model.rows)], np.float32).reshape(-1, 2))
        stats = table.stats()
        assert (stats["rows"], stats["evicted"], stats["dropped_pushes"], stats["pending_pruned"]) == \
            (len(model.rows), model.evicted, model.dropped, model.pruned)
        pending, counts = table.sightings.items()
        assert list(zip(pending.tolist(), counts.tolist())) == list(model.pending.items())
        assert len(table) <= capacity and len(table.sightings) <= max_pending


def test_a_full_table_streams_new_ids_in_constant_memory() -> None:
    """A full table fed new ids every batch keeps evicting: its index is rebuilt in place (no
    growth from tombstones), and the pending counts stay within their cap."""
    table = HashTable(4, np.dtype("float32"), capacity=5000, min_frequency=2, max_pending=3000, initializer=init.ones())
    rng = np.random.default_rng(1)
    for _ in range(40):
        batch = rng.integers(I64.min, I64.max, 1500)
        table.lookup(batch)
        table.lookup(batch[:1000])
    assert len(table) == 5000 and len(table.sightings) <= 3000
    assert table.index.buckets <= 16384 and table.stats()["index_bytes"] < 40 * (5000 + 3000)
    ids, _ = table.export()
    assert (table.lookup(ids, create=False) == 1.0).all() and len(np.unique(table.index.find(ids, table.ids))) == 5000


def test_repeats_in_one_lookup_are_one_sighting_and_get_their_rows() -> None:
    table = HashTable(2, np.dtype("float32"), min_frequency=2, initializer=init.constant(2.0))
    out = table.lookup(np.array([7, 7, 7, I64.min, I64.min], np.int64))
    assert not out.any() and len(table) == 0 and table.sightings.get(np.array([7, I64.min])).tolist() == [1, 1]
    out = table.lookup(np.array([I64.min, 7, 7], np.int64))
    assert (out == 2.0).all() and len(table) == 2 and len(table.sightings) == 0
    assert table.fresh == 2  # one row each, no slot lost to a repeat
    with pytest.raises(errors.InvalidArgument, match="gradients"):
        table.push(np.array([7], np.int64), np.ones((2, 2), np.float32))


def test_new_rows_get_the_values_of_the_tables_seeded_draws() -> None:
    """New rows in fresh slots are initialized where they lie, rows in reused slots through a
    temporary: both get the values of one draw per batch from the table's seeded generator."""
    spec = init.normal(0.5, seed=3)
    table = HashTable(8, np.dtype("float32"), initializer=spec, capacity=20_000)
    seeds = np.random.default_rng([spec.seed, 0x5EED, 0])

    def draw(n: int) -> np.ndarray:
        rng = np.random.default_rng([int(seeds.integers(0, 2**62)), 0])
        return rng.normal(0.0, 0.5, n * 8).astype(np.float32).reshape(n, 8)

    first, second = np.arange(20_000, dtype=np.int64) * 7919, np.arange(-5000, 0, dtype=np.int64)
    assert np.array_equal(table.lookup(first), draw(20_000))
    assert np.array_equal(table.lookup(second), draw(5000))  # evicts 5000 rows, reuses their slots
    assert table.fresh == 20_000 and np.array_equal(table.lookup(first[5000:], create=False), table.values[5000:20_000])


def test_big_arrays_are_zeroed_mappings_of_their_own() -> None:
    small, big = pages.zeros(10, np.int64), pages.zeros((1 << 16, 64), np.float32)
    assert small.shape == (10,) and not small.any()
    assert big.shape == (1 << 16, 64) and big.dtype == np.float32 and big.flags.writeable and not big[::997].any()
    big[-1] = 1.0
    assert big.sum() == 64 and isinstance(pages.trim(), bool)


def test_the_bench_measures_the_index_beside_a_dict() -> None:
    result = embedding_bench._dynamic_index(20_000, 3)
    for key in ("find_p50_us", "dict_find_p50_us", "lookup_p50_us", "dict_lookup_p50_us", "insert_ns_per_id",
                "dict_insert_ns_per_id", "find_speedup", "lookup_speedup", "insert_speedup"):
        assert result[key] > 0, key
    assert 4 < result["index_bytes_per_id"] <= 40 and result["dict_bytes_per_id"] > 60
    assert 12 <= result["pending_bytes_per_id"] <= 40 and result["dict_pending_bytes_per_id"] > 40
    text = embedding_bench.format_table({"throughput": [], "dynamic": result})
    assert "4096-id Zipf lookup" in text and "bytes per id pending admission" in text
    assert result["probe"] == ("C" if hash_index.compiled() else "numpy") and f"probe in {result['probe']}" in text
    if hash_index.compiled():
        assert result["numpy_lookup_p50_us"] > 0 and "the numpy rounds in the same run" in text


def test_a_step_past_the_clocks_range_is_refused_and_changes_nothing() -> None:
    """A push's step moves the table's clock (never back); one past ``MAX_CLOCK`` is refused
    before anything changes, and pushes without a step stop the clock there instead of
    overflowing the int64 step each row records."""
    table = HashTable(2, np.dtype("float32"), initializer=init.ones(), optimizer=optim.SGD(1.0))
    table.lookup(np.array([5, 6]), create=True)
    grads = np.ones((2, 2), np.float32)
    for bad in (MAX_CLOCK + 1, 2**63 - 1):
        tick = table.tick
        with pytest.raises(errors.InvalidArgument, match=f"step {bad} is past the most a table's clock counts"):
            table.push(np.array([5, 6]), grads, step=bad)
        assert table.step == 0 and table.tick == tick
        np.testing.assert_array_equal(table.lookup(np.array([5, 6]), create=False), np.ones((2, 2)))
    table.push(np.array([5]), grads[:1], step=MAX_CLOCK)
    table.push(np.array([6]), grads[1:])  # no step: one more, but not past the range
    assert table.step == MAX_CLOCK
    table.lookup(np.array([7]), create=True)  # a new row records the clock
    assert len(table) == 3
    with pytest.raises(errors.InvalidArgument, match="clock 4611686018427387905 is past"):
        table.load(np.array([8]), np.zeros((1, 2), np.float32), {}, None, clock=MAX_CLOCK + 1)
    assert len(table) == 3


def test_paging_an_export_sorts_the_table_once_until_a_row_is_made_or_dropped(monkeypatch) -> None:
    table = HashTable(2, np.dtype("float32"), initializer=init.ones())
    rng = np.random.default_rng(3)
    table.lookup(rng.choice(1 << 40, 1000, replace=False))
    whole_ids, whole_rows = table.export()
    passes = []
    live_slots = HashTable.live_slots
    monkeypatch.setattr(HashTable, "live_slots", lambda self: passes.append(1) or live_slots(self))
    pages = [table.export_page(start, 128) for start in range(0, 1000, 128)]
    assert len(passes) == 1 and [more for _, _, more in pages] == [True] * 7 + [False]
    np.testing.assert_array_equal(np.concatenate([ids for ids, _, _ in pages]), whole_ids)
    np.testing.assert_array_equal(np.concatenate([rows for _, rows, _ in pages]), whole_rows)
    ids, _, _ = table.export_page(0, 10)
    table.lookup(np.array([-5]))  # a new row, first in id order: the kept order is stale
    again, _, _ = table.export_page(0, 10)
    assert len(passes) == 3 and again[0] == -5 and list(again[1:]) == list(ids[:9])
    table.push(again[:1], np.ones((1, 2), np.float32))  # a row changed, none made or dropped: order kept
    table.export_page(10, 10)
    assert len(passes) == 3


def test_paging_by_the_last_id_sees_every_row_held_throughout_once_while_rows_come_and_go() -> None:
    """By position, a row made below the cursor shifts the rest: one comes twice; a row dropped
    below it shifts them back: one is skipped. By the last id, neither."""
    table = HashTable(2, np.dtype("float32"), initializer=init.ones())
    table.lookup(np.array([10, 20, 30, 40]))
    first, _, more = table.export_page(0, 2, after=None)
    assert list(first) == [10, 20] and more
    table.lookup(np.array([5]))  # made below the cursor
    second, _, more = table.export_page(0, 2, after=int(first[-1]))
    assert list(second) == [30, 40] and not more
    table.push(np.array([10]), np.ones((1, 2), np.float32), step=5)
    assert table.evict(older_than_step=0) == 4  # all but 10, the row changed at the clock's step
    table.lookup(np.array([1, 2, 3]))  # made below the cursor after others were dropped
    ids, _, more = table.export_page(0, 5, after=2)
    assert list(ids) == [3, 10] and not more


def test_a_restore_with_mismatched_slots_or_counts_is_refused_and_changes_nothing() -> None:
    f32 = np.dtype("float32")
    table = HashTable(4, f32, initializer=init.ones(), optimizer=optim.Adam().spec())
    table.load(np.array([1, 2]), np.full((2, 4), 3.0, np.float32), {}, None, clock=5)
    before = (len(table), table.step, table.export()[1].copy())
    values = np.full((3, 4), 7.0, np.float32)
    for slots, steps, changed, needle in (
            ({"m": np.zeros((2, 4), np.float32)}, None, None,
             r"slot 'm' rows must be float32 \[3, 4\], got float32 \[2, 4\]"),
            ({"v": np.zeros((3, 4), np.float64)}, None, None, r"slot 'v' rows must be float32 \[3, 4\], got float64"),
            ({}, np.zeros(2, np.int64), None, r"step counts must be integers of shape \[3\], got int64 \[2\]"),
            ({}, None, np.zeros(3, np.float32), r"change steps must be integers of shape \[3\], got float32 \[3\]")):
        with pytest.raises(errors.InvalidArgument, match=needle):
            table.load(np.array([1, 2, 3]), values, slots, steps, changed, clock=100)
        after = (len(table), table.step, table.export()[1])
        assert after[:2] == before[:2] and np.array_equal(after[2], before[2])
