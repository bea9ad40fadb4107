"""Dynamic tables restored exactly: their rows fit the parts they are re-hashed into (else the
restore is refused before anything changes), a restore replaces the rows a table held, ids
pending admission keep their sightings, and a save writes the rows without copying them."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import checkpoint
from zmqflow.client import checkpoint_watch
from zmqflow.errors import ResourceExhausted
from zmqflow.training.evaluate import Evaluator

from .test_checkpoint import cluster


def stop(*servers: zf.Server) -> None:
    for s in servers:
        s.stop()


def rows(sess: zf.Session, name: str = "t") -> dict[int, list[float]]:
    return {int(i): r.tolist() for ids, rs in sess.get_embedding(name).export() for i, r in zip(ids, rs)}


def test_a_table_whose_rows_would_overflow_fewer_parts_is_refused_before_anything_changes(tmp_path):
    spec, servers, worker = cluster(2, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            t = sess.embedding("t", None, 2, initializer=zf.init.normal(seed=1), capacity=8)
            t.lookup(np.arange(100, 112))  # 12 rows: fits two parts of 8, not one
            sess.variable("a", np.arange(3.0))
            saved = rows(sess)
            path = checkpoint.save(sess, str(tmp_path / "ckpt"), step=3)
    finally:
        stop(worker, *servers)
    assert len(saved) == 12
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            with pytest.raises(ResourceExhausted, match=r"table 't' .*part 0 would hold 12 rows, over its capacity "
                                                        r"of 8") as refused:
                checkpoint.restore(sess, path)
            assert refused.value.details["part"] == 0 and refused.value.details["capacity"] == 8
            assert sess.variables() == []  # nothing declared, nothing restored
    finally:
        stop(worker, *servers)
    spec, servers, worker = cluster(3, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            assert checkpoint.restore(sess, path) == 3  # three parts hold them
            assert rows(sess) == saved
    finally:
        stop(worker, *servers)


def _saves(tmp_path) -> dict[str, str]:
    """Checkpoints A (rows 1 and 2, of 5.0) and B (row 1, of 7.0) of one table, in one directory."""
    paths = {}
    for name, ids, value, step in (("A", [1, 2], 5.0, 1), ("B", [1], 7.0, 2)):
        spec, servers, worker = cluster(2, tmp_path)
        try:
            with zf.Session(worker.target) as sess:
                sess.embedding("t", None, 1, initializer=zf.init.constant(value)).lookup(np.array(ids))
                paths[name] = checkpoint.save(sess, str(tmp_path / "ckpt"), step=step, keep=0)
        finally:
            stop(worker, *servers)
    return paths


def test_a_restored_table_holds_exactly_the_checkpoints_rows(tmp_path):
    paths = _saves(tmp_path)
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            checkpoint.restore(sess, paths["A"])
            sess.get_embedding("t").lookup(np.array([40]))  # a row made since: not in B either
            assert rows(sess) == {1: [5.0], 2: [5.0], 40: [5.0]}
            checkpoint.restore(sess, paths["B"])
            assert rows(sess) == {1: [7.0]}
    finally:
        stop(worker, *servers)


def test_the_evaluator_sees_each_checkpoints_rows_alone(tmp_path):
    _saves(tmp_path)
    directory = str(tmp_path / "ckpt")
    checkpoint_watch.mark_final(directory)
    seen: dict[int, list[int]] = {}

    def eval_fn(c) -> dict[str, float]:
        seen[c.step] = sorted(rows(c.session))
        return {"rows": float(len(seen[c.step]))}

    Evaluator(eval_fn, directory, output_dir=str(tmp_path / "eval"), timeout=30).run()
    assert seen == {1: [1, 2], 2: [1]}


def test_ids_pending_admission_keep_their_sightings_across_a_restore(tmp_path):
    spec, servers, worker = cluster(2, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            t = sess.embedding("t", None, 1, initializer=zf.init.constant(1.0), min_frequency=3)
            t.lookup(np.array([5, 6, 7, 8]))
            t.lookup(np.array([5, 6, 7]))  # 5, 6, 7 seen twice, 8 once: none admitted yet
            assert rows(sess) == {}
            path = checkpoint.save(sess, str(tmp_path / "ckpt"), step=1)
    finally:
        stop(worker, *servers)
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            t = sess.embedding("t", None, 1, initializer=zf.init.constant(1.0), min_frequency=3)
            t.lookup(np.array([5, 9]))  # sightings the restore replaces
            t.lookup(np.array([9]))
            checkpoint.restore(sess, path)
            t = sess.get_embedding("t")
            t.lookup(np.array([5, 6, 7, 8, 9]))  # the third sighting of 5, 6, 7, as in the run that saved
            assert sorted(rows(sess)) == [5, 6, 7]
            t.lookup(np.array([8, 9]))
            assert sorted(rows(sess)) == [5, 6, 7, 8]  # 9's sightings before the restore are gone
    finally:
        stop(worker, *servers)


def test_a_save_writes_a_tables_rows_without_a_copy_of_them(tmp_path):
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            t = sess.embedding("t", None, 64, initializer=zf.init.normal(seed=3), optimizer=zf.optim.Adam(0.1))
            ids = np.random.default_rng(0).permutation(1 << 17).astype(np.int64)
            for chunk in np.array_split(ids, 8):
                t.lookup(chunk)
                t.push(chunk, np.ones((len(chunk), 64), np.float32))
            table = servers[0].async_server.service("ps").tables[("t", 0)]
            held = table.values.nbytes + sum(s.nbytes for s in table.slots.values())  # 96 MiB
            saved = rows(sess)
            tracemalloc.start()
            try:
                path = checkpoint.save(sess, str(tmp_path / "ckpt"), step=1)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < held // 4, f"a save of {held} bytes of rows allocated {peak}"
    finally:
        stop(worker, *servers)
    spec, servers, worker = cluster(2, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            checkpoint.restore(sess, path)
            assert rows(sess) == saved
    finally:
        stop(worker, *servers)
