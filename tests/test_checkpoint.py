"""Checkpoints: sharded, atomic, restorable onto another number of shards, crash-safe."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import checkpoint
from zmqflow.testing import make_spec

from .conftest import Proc, run_in_threads

SPARSE_IDS = np.array([1, 7, 7, 2**40])


def populate(sess: zf.Session) -> None:
    """Variables with optimizer state, a sync variable, a static and a dynamic table, all moved."""
    w = sess.variable("w", np.arange(24, dtype=np.float64).reshape(8, 3), optimizer=zf.optim.Adam(0.1),
                      partitioner=zf.fixed_size_partitioner(3))
    w.push(np.ones((8, 3)))
    w.push((np.array([0, 5]), np.ones((2, 3))))
    s = sess.variable("s", np.zeros(4), optimizer=zf.SyncReplicas(zf.optim.SGD(1.0), replicas_to_aggregate=1))
    s.push(np.ones(4))
    s.push(np.ones(4))
    sess.variable("count", 0.0).assign_add(3.0)
    emb = sess.embedding("emb", 10, 2, initializer=zf.init.normal(seed=1), optimizer=zf.optim.Adagrad(0.5))
    emb.push([1, 3, 3], np.ones((3, 2), np.float32))
    dyn = sess.embedding("dyn", None, 2, initializer=zf.init.normal(seed=2), optimizer=zf.optim.SGD(1.0))
    dyn.lookup(SPARSE_IDS)
    dyn.push(SPARSE_IDS[:2], np.ones((2, 2), np.float32))


def state(servers: list[zf.Server]) -> dict:
    """Every part and table row, with slots and step counts, keyed independently of placement."""
    out: dict = {}
    for server in servers:
        ps = server.async_server.service("ps")
        for (name, part), p in ps.store.parts.items():
            out[(name, part)] = {"value": p.value.copy(), **{f"slot.{k}": v.copy() for k, v in p.slots.items()},
                                 "steps": None if p.steps is None else p.steps.copy(),
                                 "sync": None if p.sync is None else p.sync.step}
        for (name, _), t in ps.tables.items():
            ids, rows = t.export()
            for i, r in zip(ids, rows):
                out[(name, int(i))] = r.copy()
    return out


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a, key=str) == sorted(b, key=str)
    for key in a:
        if isinstance(a[key], dict):
            for field in a[key]:
                x, y = a[key][field], b[key][field]
                if isinstance(x, np.ndarray):
                    np.testing.assert_array_equal(x, y, err_msg=f"{key} {field}")
                else:
                    assert x == y, (key, field)
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


def cluster(ps: int, root: object):
    """``ps`` shards that may write checkpoints under ``root``, and a worker."""
    spec = make_spec({"ps": ps, "worker": 1}, "tcp")
    servers = [zf.Server(spec, f"ps:{i}", checkpoint_roots=[str(root)]) for i in range(ps)]
    worker = zf.Server(spec, "worker:0")
    return spec, servers, worker


def test_save_and_restore_onto_three_shards_from_two(tmp_path):
    spec, servers, worker = cluster(2, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            populate(sess)
            path = checkpoint.save(sess, str(tmp_path))
            assert checkpoint.latest(str(tmp_path)) == path
            before = state(servers)
            manifest = json.loads(open(path).read())
            assert manifest["step"] == 2 and len(manifest["shards"]) == 2
    finally:
        for s in [worker, *servers]:
            s.stop()
    spec3, servers3, worker3 = cluster(3, tmp_path)
    try:
        with zf.Session(worker3.target) as sess:
            assert checkpoint.restore(sess, str(tmp_path)) == 2
            after = state(servers3)
            assert_same_state(before, after)
            assert {p["task"] for p in sess.get("w").partitions} == {"ps:0", "ps:1", "ps:2"}  # re-placed over 3
            assert sess.global_step() == 2
            np.testing.assert_array_equal(sess.get_embedding("dyn").lookup(SPARSE_IDS, create=False),
                                          np.stack([before[("dyn", int(i))] for i in SPARSE_IDS]))
    finally:
        for s in [worker3, *servers3]:
            s.stop()


def test_keep_the_last_n(tmp_path):
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            v = sess.variable("v", 0.0)
            for step in range(5):
                v.assign_add(1.0)
                checkpoint.save(sess, str(tmp_path), step=step, keep=2)
            found = checkpoint.checkpoints(str(tmp_path))
            assert [os.path.basename(p) for p in found] == ["checkpoint-0000000003.json", "checkpoint-0000000004.json"]
            assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) == 2
            assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    finally:
        for s in [worker, *servers]:
            s.stop()


def test_a_manifest_naming_files_outside_its_directory_is_never_read_kept_or_pruned(tmp_path):
    """A manifest is data on disk: one whose shard files lead out of the directory (absolute, or
    through ``..``) is no checkpoint, so a save's pruning never removes those files, and reading
    it names the entry at fault."""
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    victims = [outside / "victim-a", outside / "victim-b"]
    for f in victims:
        f.write_bytes(b"not yours")
    spec, servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            sess.variable("v", 0.0)
            checkpoint.save(sess, str(ckpt), step=5)
            good = json.loads((ckpt / "checkpoint-0000000005.json").read_text())
            for step, name in ((1, str(victims[0])), (2, os.path.join("..", "outside", "victim-b"))):
                planted = dict(good, step=step, shards=[dict(good["shards"][0], file=name)])
                (ckpt / f"checkpoint-{step:010d}.json").write_text(json.dumps(planted))
            assert [os.path.basename(p) for p in checkpoint.checkpoints(str(ckpt))] == ["checkpoint-0000000005.json"]
            with pytest.raises(zf.errors.InvalidArgument, match="names the file '/.*victim-a', not a plain name"):
                checkpoint.restore(sess, str(ckpt / "checkpoint-0000000001.json"))
            for step in (6, 7):
                checkpoint.save(sess, str(ckpt), step=step, keep=1)
            assert all(f.read_bytes() == b"not yours" for f in victims)
            assert checkpoint.checkpoints(str(ckpt)) == [str(ckpt / "checkpoint-0000000007.json")]
    finally:
        for s in [worker, *servers]:
            s.stop()


SAVER = textwrap.dedent(
    """
    import sys, numpy as np, zmqflow as zf
    with zf.Session(sys.argv[1]) as sess:
        sess.get("v").assign(np.full(4, 2.0))
        zf.checkpoint.save(sess, sys.argv[2], step=2)
    print("saved", flush=True)
    """
)


@pytest.mark.parametrize("where", ["before-manifest", "mid-write", "shard-mid-write"])
def test_a_crash_during_a_write_leaves_the_previous_checkpoint(tmp_path, procs, where):
    ckpt = str(tmp_path / "ckpt")
    cfile = tmp_path / "c.json"
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    cfile.write_text(spec.to_json())
    in_shard = where == "shard-mid-write"
    # the shard writes its first file and dies in the middle of its second, as under kill -9
    ps = procs([sys.executable, "-m", "zmqflow", "serve", "--cluster", str(cfile), "--task", "ps:0",
                "--checkpoint-root", str(tmp_path)],
               env={"ZMQFLOW_CHECKPOINT_CRASH": "mid-write:2"} if in_shard else None)
    ps.wait_for_line("serving ps:0", 30)
    with zf.Server(spec, "worker:0") as worker, zf.Session(worker.target) as sess:
        sess.variable("v", np.ones(4))
        first = checkpoint.save(sess, ckpt, step=1)
        script = tmp_path / "saver.py"
        script.write_text(SAVER)
        saver = Proc([sys.executable, str(script), worker.target, ckpt],
                     env={} if in_shard else {"ZMQFLOW_CHECKPOINT_CRASH": where})
        code = saver.wait(60)
        saver.kill()
    if in_shard:
        assert ps.wait(10) == 137 and code != 0, saver.output
    else:
        assert code == 137, saver.output
    assert any(".tmp-" in f for f in os.listdir(ckpt)) or where == "before-manifest"
    assert checkpoint.latest(ckpt) == first  # the half-written one does not count
    spec2, servers2, worker2 = cluster(1, tmp_path)
    try:
        with zf.Session(worker2.target) as sess:
            assert checkpoint.restore(sess, ckpt) == 1
            np.testing.assert_array_equal(sess.get("v").read(), np.ones(4))
            left = set(os.listdir(ckpt)) - _named(ckpt)
            assert left, "the crashed save left files that no complete checkpoint names"
            third = checkpoint.save(sess, ckpt, step=3)
        # the next save prunes what the crashed one left behind; both complete checkpoints stay
        assert checkpoint.checkpoints(ckpt) == [first, third]
        assert set(os.listdir(ckpt)) == _named(ckpt), sorted(os.listdir(ckpt))
    finally:
        for s in [worker2, *servers2]:
            s.stop()


def _named(directory: str) -> set[str]:
    """The manifests of complete checkpoints and the shard files they name."""
    out = set()
    for path in checkpoint.checkpoints(directory):
        out.add(os.path.basename(path))
        with open(path) as fh:
            out |= {s["file"] for s in json.load(fh)["shards"]}
    return out


def test_monitored_session_saves_and_the_next_run_restores(tmp_path):
    ckpt = str(tmp_path / "ckpt")

    def train(steps: int) -> tuple[int, np.ndarray, str | None]:
        spec = make_spec({"ps": 1, "worker": 1}, "tcp")
        with zf.Server(spec, "ps:0", checkpoint_roots=[str(tmp_path)]), zf.MonitoredTrainingSession(
            zf.ParameterServerStrategy(), cluster=spec, task="worker:0", checkpoint_dir=ckpt,
            save_checkpoint_steps=5, hooks=[zf.StopAtStep(steps)], progress=False,
        ) as mon:
            mon.create({"w": np.zeros(3)}, optimizer=zf.optim.Momentum(0.1))
            while not mon.should_stop():
                mon.apply({"w": np.ones(3)})
            return mon.step, mon.params()["w"], mon.restored_from

    step, w, restored = train(10)
    assert step == 10 and restored is None
    assert [os.path.basename(p) for p in checkpoint.checkpoints(ckpt)][-1] == "checkpoint-0000000010.json"
    step2, w2, restored2 = train(15)  # a new cluster: the chief restores step 10 and goes on to 15

    def momentum(steps: int) -> np.ndarray:
        ref, m = np.zeros(3), np.zeros(3)
        for _ in range(steps):
            m = 0.9 * m + 1.0
            ref -= 0.1 * m
        return ref

    np.testing.assert_allclose(w, momentum(10), rtol=0, atol=1e-12)
    assert restored2 is not None and step2 == 15
    np.testing.assert_allclose(w2, momentum(15), rtol=0, atol=1e-12)  # momentum slots survived the restart


def test_local_strategy_checkpoints(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    for steps in (4, 8):
        with zf.MonitoredTrainingSession(checkpoint_dir=ckpt, save_checkpoint_steps=2, hooks=[zf.StopAtStep(steps)],
                                         progress=False) as mon:
            mon.create({"w": np.zeros(2)}, optimizer=zf.optim.Adam(0.1))
            while not mon.should_stop():
                mon.apply({"w": np.ones(2)})
            last = mon.params()["w"]
    ref = zf.LocalStrategy()
    with zf.MonitoredTrainingSession(strategy=ref, hooks=[zf.StopAtStep(8)], progress=False) as mon:
        mon.create({"w": np.zeros(2)}, optimizer=zf.optim.Adam(0.1))
        while not mon.should_stop():
            mon.apply({"w": np.ones(2)})
        np.testing.assert_allclose(last, mon.params()["w"], rtol=0, atol=1e-12)


def test_ring_strategy_restores_the_chiefs_replica_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")

    def run(steps: int) -> dict[str, np.ndarray]:
        spec = make_spec({"worker": 2}, "tcp")
        servers = [zf.Server(spec, f"worker:{i}") for i in range(2)]
        finals: dict[str, np.ndarray] = {}

        def rank(i: int) -> None:
            with zf.MonitoredTrainingSession(zf.RingAllReduceStrategy(), server=servers[i], checkpoint_dir=ckpt,
                                             save_checkpoint_steps=3, hooks=[zf.StopAtStep(steps)], progress=False) as mon:
                mon.create({"w": np.zeros(2)}, optimizer=zf.optim.Adam(0.1))
                while not mon.should_stop():
                    mon.apply({"w": np.full(2, 1.0 + i)})  # the mean is 1.5 on every rank
                finals[str(mon.task)] = mon.params()["w"]

        try:
            run_in_threads(rank, 2)
        finally:
            for s in servers:
                s.stop()
        return finals

    run(6)
    finals = run(10)
    with zf.MonitoredTrainingSession(hooks=[zf.StopAtStep(10)], progress=False) as mon:
        mon.create({"w": np.zeros(2)}, optimizer=zf.optim.Adam(0.1))
        while not mon.should_stop():
            mon.apply({"w": np.full(2, 1.5)})
        expected = mon.params()["w"]
    for task, w in finals.items():
        np.testing.assert_allclose(w, expected, rtol=0, atol=1e-12, err_msg=task)


def test_two_writers_saving_into_one_directory_at_once_leave_valid_checkpoints(tmp_path):
    """A chief handing over (or a paused one resuming) may save beside its successor."""
    from zmqflow.state.store import ShardStore

    stores = []
    for k in range(2):
        store = ShardStore()
        store.create("w", 0, [3], [0, 3], "float64", value=np.full(3, float(k)))
        stores.append(store)

    refused: list[int] = []

    def writer(k: int) -> None:
        for step in range(1, 25):
            try:
                checkpoint.save_store(stores[k], str(tmp_path), step, keep=2)
            except zf.errors.Unavailable as exc:  # the later save of the other pruned its file: said, not committed
                assert "was removed by another writer" in str(exc)
                refused.append(step)

    run_in_threads(writer, 2)
    found = checkpoint.checkpoints(str(tmp_path))
    # commits take turns, so the last one, a writer's step 24 (the other's may be refused), is the latest
    assert found and os.path.basename(found[-1]) == "checkpoint-0000000024.json", (found, refused)
    step, saved = checkpoint.restore_store(found[-1])
    assert step == 24 and saved["w"]["value"].tolist() in ([0.0] * 3, [1.0] * 3)


def _replica(name: str, value: float):
    from zmqflow.state.store import ShardStore

    store = ShardStore()
    store.create(name, 0, [3], [0, 3], "float64", value=np.full(3, value))
    return store


def test_two_writers_saving_one_step_in_one_millisecond_never_share_a_file(tmp_path, monkeypatch):
    """Two chiefs (a handover) saving the same step at the same moment: each writes its own shard
    file, so whichever manifest survives names the state its own writer saved."""
    import threading
    import types

    monkeypatch.setattr(checkpoint, "time", types.SimpleNamespace(time=lambda: 1_700_000_000.0))
    both_written = threading.Barrier(2, timeout=20)
    shard_files: list[int] = []

    def between_shards_and_manifest(where: str) -> None:  # both writers' shard files are on disk here
        if where == "before-manifest":
            both_written.wait()
            shard_files.append(len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]))
            both_written.wait()

    monkeypatch.setattr(checkpoint, "crash_point", between_shards_and_manifest)
    stores = [_replica(f"w{k}", float(k)) for k in range(2)]
    run_in_threads(lambda k: checkpoint.save_store(stores[k], str(tmp_path), 5, keep=2), 2)
    assert shard_files == [2, 2]
    step, saved = checkpoint.restore_store(str(tmp_path))
    (name, arrays), = saved.items()
    assert step == 5 and arrays["value"].tolist() == [float(name[1:])] * 3, (name, arrays["value"])


def test_restoring_a_directorys_latest_while_a_writer_prunes_it_reads_the_newest(tmp_path, monkeypatch):
    """A chief restoring while another still saves (keep=1): the checkpoint it chose is pruned
    between reading the manifest and its files; it chooses the newest again."""
    checkpoint.save_store(_replica("w", 1.0), str(tmp_path), 1, keep=1)
    read = checkpoint.open_shard_file
    pruned: list[str] = []

    def read_after_a_prune(path: str, dir_fd: int | None = None):
        if not pruned:
            pruned.append(checkpoint.save_store(_replica("w", 2.0), str(tmp_path), 2, keep=1))
            assert [os.path.basename(p) for p in checkpoint.checkpoints(str(tmp_path))] == ["checkpoint-0000000002.json"]
        return read(path, dir_fd)

    monkeypatch.setattr(checkpoint, "open_shard_file", read_after_a_prune)
    step, saved = checkpoint.restore_store(str(tmp_path))
    assert pruned and step == 2 and saved["w"]["value"].tolist() == [2.0] * 3
