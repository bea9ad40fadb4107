"""Checkpoints as safetensors: every dtype round-trips, other readers open the files, restore
reads through memory mappings a part at a time, ``zmqflow checkpoint inspect``, embedding deltas."""

from __future__ import annotations

import json
import errno
import os

import numpy as np
import pytest
from click.testing import CliRunner

import zmqflow as zf
from zmqflow import checkpoint
from zmqflow.cli.main import main as cli
from zmqflow.client import checkpoint_files
from zmqflow.errors import InvalidArgument, NotFound
from zmqflow.state import snapshot, tensorfile
from zmqflow.state.droplog import DropLog
from zmqflow.state.tables import HashTable
from zmqflow.state.tensorfile import TensorFile
from zmqflow.testing import make_spec
from zmqflow.wire.dtypes import WIRE_DTYPES


def cluster(ps: int, root: object):
    spec = make_spec({"ps": ps, "worker": 1}, "tcp")
    servers = [zf.Server(spec, f"ps:{i}", checkpoint_roots=[str(root)]) for i in range(ps)]
    return servers, zf.Server(spec, "worker:0")


def stop(*servers: zf.Server) -> None:
    for s in servers:
        s.stop()


def sample(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype.kind == "b":
        return (np.arange(n) % 3 == 0).reshape(shape)
    if dtype.kind == "c":
        return (np.arange(n) * 1.5 - 2j * np.arange(n)).astype(dtype).reshape(shape)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.concatenate([np.array([info.min, info.max], dtype), np.arange(n - 2).astype(dtype)])[:n].reshape(shape)
    return (np.arange(n) * 0.37 - 1.25).astype(dtype).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
def test_every_dtype_round_trips_whole_and_by_rows(tmp_path, name):
    dt = WIRE_DTYPES[name]
    arrays = {"m": sample(dt, (5, 3)), "scalar": sample(dt, (1,)).reshape(()), "empty": np.zeros((0, 4), dt),
              "big_endian": sample(dt, (4,)).astype(dt.newbyteorder(">"))}
    path = str(tmp_path / "x.safetensors")
    snapshot.write_atomic(path, arrays, metadata={"k": "v"})
    f = TensorFile(path)
    assert f.metadata["k"] == "v"
    for key, arr in arrays.items():
        want = arr.astype(arr.dtype.newbyteorder("=")) if arr.dtype.byteorder == ">" else arr
        assert f.dtype(key) == name and f.shape(key) == arr.shape
        assert same_bits(f.read(key), want), key
    assert same_bits(f.read("m", 1, 4), arrays["m"][1:4])


def test_a_dtype_without_a_safetensors_dtype_is_refused_by_name(tmp_path):
    with pytest.raises(InvalidArgument, match="'s'.*<U1"):
        snapshot.write_atomic(str(tmp_path / "x.safetensors"), {"s": np.array(["a"])})
    assert os.listdir(tmp_path) == []  # a failed write leaves no temporary behind


def populate(sess: zf.Session) -> None:
    w = sess.variable("w", np.arange(24, dtype=np.float32).reshape(8, 3), optimizer=zf.optim.Adam(0.1),
                      partitioner=zf.fixed_size_partitioner(3))
    w.push(np.ones((8, 3), np.float32))
    sess.variable("h", sample(np.dtype("float16"), (4, 2)))
    sess.variable("i", sample(np.dtype("int64"), (6,)))
    dyn = sess.embedding("dyn", None, 4, initializer=zf.init.normal(seed=3), optimizer=zf.optim.Adagrad(0.5))
    ids = np.arange(40) * 7919
    dyn.lookup(ids)
    for step in range(1, 6):  # ids 8*(step-1) .. 8*step-1 change at step
        dyn.push(ids[8 * (step - 1): 8 * step], np.full((8, 4), step, np.float32), step=step)


def test_shard_files_are_safetensors_other_tools_read(tmp_path):
    servers, worker = cluster(2, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            populate(sess)
            path = checkpoint.save(sess, str(tmp_path / "ckpt"))
            w = sess.get("w").read()
    finally:
        stop(worker, *servers)
    manifest = json.loads(open(path).read())
    assert manifest["format"] == 2
    from safetensors import safe_open

    names: set[str] = set()
    for shard in manifest["shards"]:
        file = os.path.join(tmp_path, "ckpt", shard["file"])
        assert file.endswith(".safetensors")
        with safe_open(file, framework="numpy") as f:
            names |= set(f.keys())
            meta = f.metadata()
            assert meta["format"] == snapshot.FILE_FORMAT and json.loads(meta["entries"])
            for part in range(3):
                if f"w/part_{part}" in f.keys():
                    rows = next(e["rows"] for e in json.loads(meta["entries"]) if e["key"] == f"w/part_{part}")
                    np.testing.assert_array_equal(f.get_tensor(f"w/part_{part}"), w[rows[0]:rows[1]])
    assert {"w/part_0", "w/part_1", "w/part_2", "w/part_0/slot/m", "w/part_0/slot/v", "w/part_0/steps", "h", "i",
            "dyn/part_0/ids", "dyn/part_0/values", "dyn/part_0/slot/accumulator", "dyn/part_0/changed",
            "dyn/part_1/ids"} <= names, sorted(names)
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    for shard in manifest["shards"]:
        loaded = load_file(os.path.join(tmp_path, "ckpt", shard["file"]))
        if "w/part_0" in loaded:
            assert torch.equal(loaded["w/part_0"], torch.from_numpy(w[:3].copy()))
        assert all(isinstance(t, torch.Tensor) for t in loaded.values())


@pytest.mark.parametrize("m, m2", [(3, 1), (1, 2)])
def test_restore_reshards_and_reads_through_the_mapping(tmp_path, monkeypatch, m, m2):
    servers, worker = cluster(m, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            populate(sess)
            checkpoint.save(sess, str(tmp_path / "ckpt"), step=5)
            want = {n: sess.get(n).read() for n in ("w", "h", "i")}
            dyn_ids = np.arange(40) * 7919
            rows = sess.get_embedding("dyn").lookup(dyn_ids, create=False)
    finally:
        stop(worker, *servers)
    reads: list[tuple[str, str]] = []
    opened = TensorFile.__init__

    def spy_open(self: TensorFile, path: str, dir_fd: int | None = None) -> None:  # reads go through safe_open
        opened(self, path, dir_fd)
        inner = self._file

        class Spy:
            def get_tensor(self, name: str) -> np.ndarray:
                reads.append(("tensor", name))
                return inner.get_tensor(name)

            def get_slice(self, name: str):
                reads.append(("slice", name))
                return inner.get_slice(name)

        self._file = Spy()

    monkeypatch.setattr(TensorFile, "__init__", spy_open)
    monkeypatch.setattr(snapshot, "read_arrays", lambda path, *_: pytest.fail(f"{path} read whole"))
    servers2, worker2 = cluster(m2, tmp_path)
    try:
        with zf.Session(worker2.target) as sess:
            assert checkpoint.restore(sess, str(tmp_path / "ckpt")) == 5
            for n, v in want.items():
                assert same_bits(sess.get(n).read(), v), n
            np.testing.assert_array_equal(sess.get_embedding("dyn").lookup(dyn_ids, create=False), rows)
            # a restored table keeps each row's change step: the delta since 5 is the rows pushed at 5;
            # deletions before the restore are unknown, so an older delta asks for a full export
            got = _read_delta(sess.get_embedding("dyn").export_delta(5, str(tmp_path / "d")))
            np.testing.assert_array_equal(got["ids"], np.sort(dyn_ids[32:]))
            with pytest.raises(InvalidArgument, match="full export"):
                sess.get_embedding("dyn").export_delta(4, str(tmp_path / "d"))
    finally:
        stop(worker2, *servers2)
    # each tensor read once, by name, from its own file: never a whole file
    assert ("tensor", "w/part_1") in reads and ("tensor", "dyn/part_0/values") in reads
    assert len([r for r in reads if r[1] == "w/part_1"]) == 1


def test_reading_rows_slices_through_safe_open(tmp_path, monkeypatch):
    path = str(tmp_path / "x.safetensors")
    snapshot.write_atomic(path, {"big": np.arange(1000.0).reshape(100, 10)})
    f = TensorFile(path)
    calls = []
    inner = f._file
    monkeypatch.setattr(f, "_file", type("S", (), {"get_slice": lambda self, n: calls.append(n) or inner.get_slice(n),
                                                   "get_tensor": lambda self, n: pytest.fail("whole tensor read")})())
    np.testing.assert_array_equal(f.read("big", 10, 12), np.arange(100.0, 120.0).reshape(2, 10))
    assert calls == ["big"]


def test_a_failure_before_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            v = sess.variable("v", np.ones(4))
            first = checkpoint.save(sess, str(tmp_path), step=1)
            v.assign(np.full(4, 2.0))

            def half_then_fail(fh, tensors, metadata=None):
                fh.write(b"\x10\x00")
                raise OSError(errno.ENOSPC, "No space left on device")

            monkeypatch.setattr(snapshot, "write_tensors", half_then_fail)
            with pytest.raises(zf.errors.ResourceExhausted, match="cannot write .*: No space left on device"):
                checkpoint.save(sess, str(tmp_path), step=2)
            monkeypatch.undo()
            assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # nothing half-written left
            assert checkpoint.latest(str(tmp_path)) == first
            assert checkpoint.restore(sess, str(tmp_path)) == 1
            np.testing.assert_array_equal(sess.get("v").read(), np.ones(4))
    finally:
        stop(worker, *servers)


def test_format_1_npz_checkpoints_are_still_read(tmp_path):
    arrays = {"p0.value": np.arange(3.0), "p0.steps": np.zeros(3, np.int64)}
    np.savez(tmp_path / "step0000000007-1-ab-replica.npz", **arrays)
    manifest = {"format": 1, "step": 7, "records": [], "shards": [{"task": "local", "file": "step0000000007-1-ab-replica.npz",
                "entries": [{"kind": "part", "name": "v", "part": 0, "key": "p0", "rows": [0, 3]}]}]}
    (tmp_path / "checkpoint-0000000007.json").write_text(json.dumps(manifest))
    step, saved = checkpoint.restore_store(str(tmp_path))
    assert step == 7 and saved["v"]["value"].tolist() == [0.0, 1.0, 2.0]
    out = CliRunner().invoke(cli, ["checkpoint", "inspect", "--json", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["checkpoint"]["variables"][0]["name"] == "v"


def test_inspect_lists_what_a_checkpoint_holds(tmp_path):
    servers, worker = cluster(2, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            populate(sess)
            checkpoint.save(sess, str(tmp_path / "ckpt"), step=5)
    finally:
        stop(worker, *servers)
    runner = CliRunner()
    out = runner.invoke(cli, ["checkpoint", "inspect", "--json", str(tmp_path / "ckpt")])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)["checkpoint"]
    assert info["step"] == 5 and info["format"] == 2 and len(info["files"]) == 2
    w = next(v for v in info["variables"] if v["name"] == "w")
    assert w["dtype"] == "float32" and w["shape"] == [8, 3] and w["parts"] == 3 and w["slots"] == ["m", "v"]
    assert w["partitioning"] == [[0, 3], [3, 6], [6, 8]] and set(w["shards"]) <= {"ps:0", "ps:1"}
    assert w["bytes"] == 8 * 3 * 4 * 3 + 8 * 8  # value, two slots, int64 step counts
    dyn, = info["tables"]
    assert dyn["rows"] == 40 and dyn["dim"] == 4 and dyn["parts"] == 2 and dyn["slots"] == ["accumulator"]
    assert info["bytes"] == sum(os.path.getsize(tmp_path / "ckpt" / f["file"]) for f in info["files"])
    text = runner.invoke(cli, ["checkpoint", "inspect", str(tmp_path / "ckpt")])
    assert text.exit_code == 0 and "step 5" in text.output and "w" in text.output and "8x3" in text.output
    assert "0:3 3:6 6:8" in text.output and "dyn" in text.output


def test_inspect_refuses_what_is_not_a_checkpoint_and_names_a_truncated_file(tmp_path):
    runner = CliRunner()
    (tmp_path / "empty").mkdir()
    out = runner.invoke(cli, ["checkpoint", "inspect", str(tmp_path / "empty")])
    assert out.exit_code == 1 and "not a checkpoint directory" in out.output
    out = runner.invoke(cli, ["checkpoint", "inspect", str(tmp_path / "nowhere")])
    assert out.exit_code == 1 and "does not exist" in out.output
    servers, worker = cluster(1, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            sess.variable("v", np.arange(1000.0))
            path = checkpoint.save(sess, str(tmp_path / "ckpt"), step=1)
    finally:
        stop(worker, *servers)
    shard = json.loads(open(path).read())["shards"][0]["file"]
    full = tmp_path / "ckpt" / shard
    full.write_bytes(full.read_bytes()[:-100])
    out = runner.invoke(cli, ["checkpoint", "inspect", str(tmp_path / "ckpt")])
    assert out.exit_code == 1 and shard in out.output and "truncated" in out.output, out.output
    with pytest.raises(InvalidArgument, match=shard):
        checkpoint_files.describe(str(tmp_path / "ckpt"))


# embedding deltas ---------------------------------------------------------------------------

def _read_delta(manifest: str) -> dict[str, np.ndarray]:
    info = json.loads(open(manifest).read())
    directory = os.path.dirname(manifest)
    files = [TensorFile(os.path.join(directory, p["file"])) for p in info["parts"]]
    ids = np.concatenate([f.read("ids") for f in files])
    order = np.argsort(ids)
    return {"ids": ids[order], "values": np.concatenate([f.read("values") for f in files])[order],
            "dropped": np.sort(np.concatenate([f.read("dropped") for f in files])), "step": info["step"]}


def test_delta_holds_the_rows_changed_since_a_step_and_the_dropped_ids(tmp_path):
    servers, worker = cluster(2, tmp_path)
    try:
        with zf.Session(worker.target) as sess:
            populate(sess)
            dyn = sess.get_embedding("dyn")
            ids = np.arange(40) * 7919
            first = dyn.export_delta(3, str(tmp_path / "d"))
            got = _read_delta(first)
            changed = np.sort(ids[16:])  # pushed at steps 3, 4, 5 (since is inclusive)
            np.testing.assert_array_equal(got["ids"], changed)
            np.testing.assert_array_equal(got["values"], dyn.lookup(changed, create=False))
            assert got["dropped"].size == 0 and got["step"] == 5
            after = json.loads(open(first).read())["next_since"]
            assert after == 5  # every part saw a push at step 5
            assert dyn.evict(older_than_steps=1) == 24  # rows last changed before step 4 go
            dyn.push(ids[:1], np.ones((1, 4), np.float32), step=6)  # dropped: a push does not bring it back
            dyn.lookup(ids[:2])  # ids[0:2] come back, each at its part's clock
            got = _read_delta(dyn.export_delta(after, str(tmp_path / "d")))
            np.testing.assert_array_equal(got["ids"], np.sort(np.concatenate([ids[:2], ids[32:]])))
            np.testing.assert_array_equal(got["dropped"], np.sort(ids[2:24]))
            out = CliRunner().invoke(cli, ["checkpoint", "inspect", "--json", str(tmp_path / "d")])
            assert out.exit_code == 0, out.output
            deltas = json.loads(out.output)["deltas"]
            assert [(d["since"], d["rows"], d["dropped"]) for d in deltas] == [(3, 24, 0), (5, 10, 22)]
    finally:
        stop(worker, *servers)


def test_a_delta_older_than_the_drop_log_asks_for_a_full_export(tmp_path):
    t = HashTable(2, np.float32, drop_log=4)
    t.lookup(np.arange(10))
    for s in range(1, 4):
        t.push(np.arange(10), np.ones((10, 2), np.float32), step=s)
        t.evict(older_than_step=-1) if s == 3 else None
    t.lookup(np.arange(100, 103))
    t.push(np.arange(100, 103), np.ones((3, 2), np.float32), step=7)
    t.evict(older_than_step=0)  # rows 100..102 stay (changed at 7), the rest of the table went at 3
    with pytest.raises(InvalidArgument, match="full export"):
        t.delta(0)
    d = t.delta(7)
    assert d["ids"].tolist() == [100, 101, 102] and d["dropped"].size == 0


def test_drop_log_keeps_the_newest_and_says_where_it_starts():
    log = DropLog(cap=4)
    for step, ids in enumerate([[1], [2, 3], [4], [5, 6]], start=1):
        log.record(np.array(ids), step)
    assert log.since > 1 and len(log) <= 4
    assert log.since == 3 and log.since_step(3, "x").tolist() == [4, 5, 6]
    with pytest.raises(InvalidArgument, match="from step"):
        log.since_step(1, "x")


def test_without_steps_a_part_counts_its_pushes():
    t = HashTable(2, np.float32)
    t.lookup(np.arange(4))
    t.push(np.array([0]), np.ones((1, 2), np.float32))
    t.push(np.array([1]), np.ones((1, 2), np.float32))
    assert t.step == 2 and t.delta(2)["ids"].tolist() == [1] and t.delta(1)["ids"].tolist() == [0, 1]
    t.push(np.array([2]), np.ones((1, 2), np.float32), step=1)  # a late step never moves the clock back
    assert t.step == 2 and t.delta(2)["ids"].tolist() == [1, 2]


def test_delta_export_stays_in_the_checkpoint_roots(tmp_path):
    servers, worker = cluster(1, tmp_path / "root")
    try:
        with zf.Session(worker.target) as sess:
            dyn = sess.embedding("dyn", None, 2)
            dyn.lookup([1, 2])
            with pytest.raises(zf.errors.PermissionDenied):
                dyn.export_delta(0, str(tmp_path / "elsewhere"))
            assert not (tmp_path / "elsewhere").exists()
            with pytest.raises(InvalidArgument, match="static"):
                sess.embedding("st", 10, 2).export_delta(0, str(tmp_path / "root"))
            with pytest.raises(NotFound):
                checkpoint_files.describe(str(tmp_path / "root"))
    finally:
        stop(worker, *servers)


def test_tensorfile_names_a_missing_or_foreign_file(tmp_path):
    with pytest.raises(NotFound, match="nope"):
        TensorFile(str(tmp_path / "nope.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(InvalidArgument, match="junk.safetensors"):
        TensorFile(str(tmp_path / "junk.safetensors"))
    assert tensorfile.ST_DTYPES["bfloat16"] == "BF16"
