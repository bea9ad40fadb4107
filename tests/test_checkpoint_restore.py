"""Restores that check everything before they change anything, and checkpoints ordered by when
they were saved (a run restored to an older checkpoint and trained on saves the newest ones)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import checkpoint
from zmqflow.errors import InvalidArgument, VariableConflict

from .test_checkpoint import assert_same_state, cluster, state


def stop(*servers: zf.Server) -> None:
    for s in servers:
        s.stop()


@pytest.fixture
def saved(tmp_path) -> Path:
    """A checkpoint of ``a`` (two parts, Adam), ``z`` (Adam) and ``dyn`` (a dynamic table), with
    its records in that order: a restore would reach ``a`` first."""
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            a = sess.variable("a", np.arange(12.0).reshape(6, 2), optimizer=zf.optim.Adam(0.1),
                              partitioner=zf.fixed_size_partitioner(2))
            a.push(np.ones((6, 2)))
            sess.variable("z", np.arange(4.0), optimizer=zf.optim.Adam(0.1)).push(np.ones(4))
            dyn = sess.embedding("dyn", None, 2, initializer=zf.init.normal(seed=1), optimizer=zf.optim.SGD(1.0))
            dyn.lookup(np.array([3, 9]))
            dyn.push(np.array([3, 9]), np.ones((2, 2), np.float32))
            path = Path(checkpoint.save(sess, str(tmp_path / "ckpt"), step=7))
    finally:
        stop(worker, *servers)
    manifest = json.loads(path.read_text())
    manifest["records"].sort(key=lambda r: ["a", "z", "dyn"].index(r["name"]))
    path.write_text(json.dumps(manifest))
    return path


def _record(manifest: dict, name: str) -> dict:
    return next(r for r in manifest["records"] if r["name"] == name)


def _no_part(m: dict) -> None:
    for shard in m["shards"]:
        shard["entries"] = [e for e in shard["entries"] if e["name"] != "z"]


BAD_FILES = {
    "a part no file holds": (_no_part, "'z': no shard file holds its part 0"),
    "a dtype the file disagrees with": (lambda m: _record(m, "z").update(dtype="float32"),
                                        r"'z': part 0's value is float64 \[4\] in its file, expected float32 \[4\]"),
    "a shape the file disagrees with": (lambda m: _record(m, "z").update(shape=[5]),
                                        r"'z': part 0 holds rows \[0, 4\], expected 5 row\(s\)"),
    "table rows of another width": (lambda m: _record(m, "dyn")["table"].update(dim=3),
                                    r"'dyn': part 0's values is float32 \[2, 2\] in its file, "
                                    r"expected float32 \[2, 3\]"),
    "slots its optimizer has not": (lambda m: _record(m, "z").update(optimizer={"kind": "sgd", "learning_rate": 0.1}),
                                    r"'z': the checkpoint holds optimizer slots \['m', 'v'\]"),
    "a table without min_frequency": (lambda m: _record(m, "dyn")["table"].pop("min_frequency"),
                                      r"'dyn': its table description .* is not one this version reads"),
    "a table of no capacity": (lambda m: _record(m, "dyn")["table"].update(capacity="lots"),
                               r"'dyn': its table description .* is not one this version reads"),
    "an unknown initializer": (lambda m: _record(m, "dyn").update(initializer={"kind": "nonsense"}),
                               r"'dyn': its initializer is not one this version knows"),
    "an initializer of no numbers": (lambda m: _record(m, "dyn").update(initializer={"kind": "normal", "stddev": "x"}),
                                     r"'dyn': its initializer .* has a field that is not a number"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_checkpoint_bad_in_a_later_record_is_refused_before_anything_changes(tmp_path, saved, case):
    spoil, message = BAD_FILES[case]
    good = saved.read_text()
    manifest = json.loads(good)
    spoil(manifest)
    saved.write_text(json.dumps(manifest))
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            sess.variable("a", np.full((6, 2), -1.0), optimizer=zf.optim.Adam(0.1),
                          partitioner=zf.fixed_size_partitioner(2)).push(np.ones((6, 2)))
            before = state(servers)
            with pytest.raises(InvalidArgument, match=message) as refused:
                checkpoint.restore(sess, str(saved))
            assert refused.value.details["file"] == str(saved)
            assert_same_state(state(servers), before)  # 'a', its slots and steps: as they were
            assert sorted(v["name"] for v in sess.variables()) == ["a"]  # nothing declared either
            saved.write_text(good)
            assert checkpoint.restore(sess, str(saved)) == 7  # the same cluster takes the good one
            np.testing.assert_allclose(sess.get("z").read(), np.arange(4.0) - 0.1, rtol=1e-6)
    finally:
        stop(worker, *servers)


@pytest.mark.parametrize("how", ["restore", "recover"])
@pytest.mark.parametrize("live", ["another shape", "an optimizer without its slots", "a table's other optimizer"])
def test_a_checkpoint_the_cluster_cannot_take_is_refused_before_anything_changes(tmp_path, saved, live, how):
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            sess.variable("a", np.full((6, 2), -1.0), optimizer=zf.optim.Adam(0.1),
                          partitioner=zf.fixed_size_partitioner(2)).push(np.ones((6, 2)))
            if live == "another shape":
                sess.variable("z", np.zeros(7), optimizer=zf.optim.Adam(0.1))
            elif live == "an optimizer without its slots":
                sess.variable("z", np.zeros(4), optimizer=zf.optim.SGD(0.1))
            else:  # 'dyn' comes last: the records before it would be restored first
                sess.variable("z", np.zeros(4), optimizer=zf.optim.Adam(0.1))
                sess.embedding("dyn", None, 2, initializer=zf.init.normal(seed=1), optimizer=zf.optim.SGD(0.5))
            before = state(servers)
            error, message = {
                "another shape": (VariableConflict, r"cannot restore 'z' .*holds it as a variable float64 \[7\]"),
                "an optimizer without its slots": (InvalidArgument, r"'z': .*\['m', 'v'\], which its optimizer on "
                                                                    r"the cluster \(SGD\) does not have"),
                "a table's other optimizer": (VariableConflict, r"cannot restore 'dyn' .*the cluster holds it with "
                                                                r"optimizer .*'learning_rate': 0.5"),
            }[live]
            with pytest.raises(error, match=message):
                getattr(checkpoint, how)(sess, str(saved))
            assert_same_state(state(servers), before)
            assert checkpoint.fenced(sess) == []  # a recovery refused before it fenced anything
            assert sorted(v["name"] for v in sess.variables()) == ["a", *(["dyn"] if "table" in live else []), "z"]
    finally:
        stop(worker, *servers)


def test_saves_after_a_restore_to_an_older_checkpoint_are_the_latest_and_are_kept(tmp_path):
    """As TF's CheckpointManager: the latest checkpoint is the last saved, and ``keep`` keeps the
    last saved, whatever their steps; files a crashed save left behind go by when that save began."""
    ckpt = tmp_path / "ckpt"
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            v = sess.variable("v", np.zeros(3))
            paths = {}
            for step in (10, 20, 30):
                v.assign(np.full(3, float(step)))
                paths[step] = checkpoint.save(sess, str(ckpt), step=step, keep=2)
            assert checkpoint.checkpoints(str(ckpt)) == [paths[20], paths[30]]
            assert checkpoint.restore(sess, paths[20]) == 20  # back to 20; 30 is a path abandoned
            # a save on the abandoned path crashed before its manifest, long ago; one begun later is at work
            crashed = ckpt / f"step0000000035-{int(time.time() * 1000) - 60_000}-deadbeef-ps0.safetensors"
            at_work = ckpt / f"step0000000001-{int(time.time() * 1000) + 60_000}-feedface-ps0.safetensors"
            crashed.write_bytes(b"")
            at_work.write_bytes(b"")
            v.assign(np.full(3, 25.0))
            paths[25] = checkpoint.save(sess, str(ckpt), step=25, keep=2)
            assert checkpoint.latest(str(ckpt)) == paths[25]
            assert checkpoint.checkpoints(str(ckpt)) == [paths[30], paths[25]]
            assert not crashed.exists() and at_work.exists()
            paths[26] = checkpoint.save(sess, str(ckpt), step=26, keep=2)
            assert checkpoint.checkpoints(str(ckpt)) == [paths[25], paths[26]]  # 30 went, the fresh ones stay
            assert [json.loads(Path(p).read_text())["seq"] for p in (paths[25], paths[26])] == [4, 5]
            v.assign(np.zeros(3))
            assert checkpoint.restore(sess, str(ckpt)) == 26
            np.testing.assert_array_equal(v.read(), np.full(3, 25.0))
            assert set(os.listdir(ckpt)) == {os.path.basename(paths[25]), os.path.basename(paths[26]), at_work.name,
                                            *(s["file"] for p in (25, 26)
                                              for s in json.loads(Path(paths[p]).read_text())["shards"])}
    finally:
        stop(worker, *servers)


def test_checkpoints_from_before_saves_were_numbered_come_first_by_time(tmp_path):
    """A manifest without ``seq`` (written before saves were numbered) is older than any with one."""
    checkpoint.save_store(_replica(1.0), str(tmp_path), 50, keep=0)
    old = tmp_path / "checkpoint-0000000050.json"
    manifest = json.loads(old.read_text())
    del manifest["seq"]
    old.write_text(json.dumps(manifest))
    new = checkpoint.save_store(_replica(2.0), str(tmp_path), 40, keep=0)
    assert checkpoint.checkpoints(str(tmp_path)) == [str(old), new]
    assert checkpoint.restore_store(str(tmp_path))[0] == 40


def _replica(value: float):
    from zmqflow.state.store import ShardStore

    store = ShardStore()
    store.create("w", 0, [3], [0, 3], "float64", value=np.full(3, value))
    return store
