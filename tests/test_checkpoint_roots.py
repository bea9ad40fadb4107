"""Confined checkpoint files: a ps task writes only under its checkpoint roots; a save naming a
directory that resolves elsewhere is PermissionDenied and creates nothing."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import checkpoint, errors
from zmqflow.cli.launch import launch_roots
from zmqflow.cluster import ClusterSpec
from zmqflow.server.checkpoint_roots import ENV, CheckpointRoots
from zmqflow.testing import make_spec

from .conftest import ZMQFLOW


@pytest.fixture(autouse=True)
def no_roots_from_the_environment(monkeypatch):
    """Only what each test sets: a developer's own ZMQFLOW_CHECKPOINT_ROOTS must not leak in."""
    monkeypatch.delenv(ENV, raising=False)


def tree(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, ds, fs in os.walk(path) for n in ds + fs)


def test_confine_resolves_links_and_dots_before_deciding(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    roots = CheckpointRoots([root])
    assert roots.confine(str(root)) == str(root.resolve())
    assert roots.confine(str(root / "a" / "b")) == str((root / "a" / "b").resolve())
    assert roots.confine(str(root / "x" / ".." / "y")) == str((root / "y").resolve())
    for bad in (outside, root / "link", root / "link" / "sub", root / ".." / "outside", tmp_path / "rootx", "/"):
        with pytest.raises(errors.PermissionDenied, match="outside this task's checkpoint roots"):
            roots.confine(str(bad))
    with pytest.raises(errors.PermissionDenied, match="--checkpoint-root DIR"):
        CheckpointRoots().confine(str(root))
    assert CheckpointRoots(anywhere=True).confine(str(outside)) == str(outside.resolve())
    assert tree(tmp_path) == ["outside", "root", "root/link"]  # deciding created nothing


def test_roots_from_arguments_and_the_environment(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert CheckpointRoots.parse([a, b]).roots == (a, b)
    assert CheckpointRoots.parse(None, {ENV: os.pathsep.join([a, b])}).roots == (a, b)
    assert CheckpointRoots.parse("*").anywhere and CheckpointRoots.parse(None, {ENV: "*"}).anywhere
    for nothing in (None, ""):
        parsed = CheckpointRoots.parse(nothing, {} if nothing is None else {ENV: nothing})
        assert parsed.roots == () and not parsed.anywhere
    with pytest.raises(errors.ConfigError, match="cannot be combined"):
        CheckpointRoots.parse(["*", a])
    assert CheckpointRoots.parse(CheckpointRoots.parse([a, b]).to_env()).roots == (a, b)


def test_launch_confines_only_when_asked_or_beyond_loopback(tmp_path):
    local = ClusterSpec({"worker": ["127.0.0.1:2222", "localhost:2223"], "ps": ["ipc:///tmp/x.sock"]})
    remote = ClusterSpec({"worker": ["127.0.0.1:2222"], "ps": ["10.0.0.20:2222"]})
    assert launch_roots(local, [], {}).anywhere
    assert not launch_roots(remote, [], {}).anywhere and launch_roots(remote, [], {}).roots == ()
    given = launch_roots(local, [str(tmp_path)], {ENV: "*"})
    assert given.roots == (str(tmp_path.resolve()),) and not given.anywhere
    assert launch_roots(local, [], {ENV: str(tmp_path)}).roots == (str(tmp_path.resolve()),)


@pytest.fixture
def confined(tmp_path):
    """A session on a cluster whose ps shard writes checkpoints under ``tmp_path/root`` only."""
    root = tmp_path / "root"
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    with zf.Server(spec, "ps:0", checkpoint_roots=[str(root)]), zf.Server(spec, "worker:0") as worker:
        with zf.Session(worker.target) as sess:
            sess.variable("v", np.arange(4.0))
            yield sess, root


def test_a_save_outside_the_roots_is_refused_and_creates_nothing(confined, tmp_path):
    sess, root = confined
    outside = tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    (root / "link").symlink_to(outside)
    before = tree(tmp_path)
    for directory in (tmp_path / "elsewhere", outside / "new", root / "link" / "new", root / "link",
                      root / ".." / "escaped", f"{root}/../outside/new"):
        with pytest.raises(errors.PermissionDenied, match="outside this task's checkpoint roots"):
            checkpoint.save(sess, str(directory), step=1)
        with pytest.raises(errors.PermissionDenied):  # the raw request, as any peer could send it
            sess.call("ps", "save", {"directory": str(directory), "file": "x.safetensors"}, task="ps:0")
        assert tree(tmp_path) == before, directory
    path = checkpoint.save(sess, str(root / "run" / "1"), step=1)  # inside: as ever
    assert checkpoint.latest(str(root / "run" / "1")) == path
    reply = sess.call("ps", "save", {"directory": str(root / "raw"), "file": "x.safetensors"}, task="ps:0")
    assert reply["file"] == "x.safetensors" and (root / "raw" / "x.safetensors").is_file()
    assert tree(outside) == []


def test_a_file_name_too_long_for_its_temporary_is_refused_and_creates_nothing(confined, tmp_path):
    """The request allows 255 characters; with the temporary's suffix the name would be over the
    255 bytes a file system takes: a typed error up front, not an OSError halfway. A directory
    that cannot be made is the caller's error too."""
    sess, root = confined
    root.mkdir()
    (root / "afile").write_text("")
    before = tree(tmp_path)
    for name in ("x" * 255, "x" * 230, "é" * 120):
        with pytest.raises(errors.InvalidArgument, match="over the 255 a name may have"):
            sess.call("ps", "save", {"directory": str(root / "raw"), "file": name}, task="ps:0")
    with pytest.raises(errors.InvalidArgument, match="a name in it is over the 255 bytes"):
        sess.call("ps", "save", {"directory": str(root / "a" / ("d" * 300)), "file": "x"}, task="ps:0")
    with pytest.raises(errors.InvalidArgument, match="cannot make checkpoint directory .*Not a directory"):
        sess.call("ps", "save", {"directory": str(root / "afile" / "sub"), "file": "x"}, task="ps:0")
    assert tree(tmp_path) == before
    reply = sess.call("ps", "save", {"directory": str(root / "raw"), "file": "x" * 150}, task="ps:0")
    assert reply["file"] == "x" * 150 and (root / "raw" / ("x" * 150)).is_file()


def test_an_in_process_server_without_roots_refuses_and_says_how(tmp_path):
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    with zf.Server(spec, "ps:0"), zf.Server(spec, "worker:0") as worker, zf.Session(worker.target) as sess:
        sess.variable("v", 1.0)
        with pytest.raises(errors.PermissionDenied, match="checkpoint_roots=\\[DIR\\]"):
            checkpoint.save(sess, str(tmp_path / "ckpt"))
    assert tree(tmp_path) == []


def test_serve_without_a_root_refuses_with_the_hint_and_with_one_saves(procs, tmp_path):
    cfile = tmp_path / "c.json"
    spec = make_spec({"ps": 2, "worker": 1}, "tcp")
    cfile.write_text(spec.to_json())
    serve = [*ZMQFLOW, "serve", "--cluster", str(cfile)]
    bare = procs([*serve, "--task", "ps:0"])
    rooted = procs([*serve, "--task", "ps:1", "--checkpoint-root", str(tmp_path / "ckpt")])
    bare.wait_for_line("serving ps:0", 30)
    rooted.wait_for_line("serving ps:1", 30)
    with zf.Server(spec, "worker:0") as worker, zf.Session(worker.target) as sess:
        with pytest.raises(errors.PermissionDenied, match="--checkpoint-root DIR"):
            sess.call("ps", "save", {"directory": str(tmp_path / "ckpt"), "file": "x.safetensors"}, task="ps:0")
        assert not (tmp_path / "ckpt").exists()
        sess.call("ps", "save", {"directory": str(tmp_path / "ckpt" / "a"), "file": "x.safetensors"}, task="ps:1")
        assert (tmp_path / "ckpt" / "a" / "x.safetensors").is_file()
        with pytest.raises(errors.PermissionDenied, match="outside"):
            sess.call("ps", "save", {"directory": str(tmp_path / "other"), "file": "x.safetensors"}, task="ps:1")
    assert not (tmp_path / "other").exists()


SAVER = textwrap.dedent(
    """
    import os, sys, numpy as np, zmqflow as zf
    with zf.MonitoredTrainingSession(zf.ParameterServerStrategy(), checkpoint_dir=sys.argv[1],
                                     save_checkpoint_steps=2, hooks=[zf.StopAtStep(4)], progress=False) as mon:
        mon.create({"w": np.zeros(2)})
        while not mon.should_stop():
            mon.apply({"w": np.ones(2)})
    print("trained", flush=True)
    try:
        with zf.Session(cluster=os.environ["ZMQFLOW_CLUSTER"], task="ps:0") as sess:
            zf.checkpoint.save(sess, sys.argv[2], step=99)
        print("saved outside", flush=True)
    except zf.errors.PermissionDenied as exc:
        print("refused:", exc, flush=True)
    """
)


@pytest.mark.parametrize("confine", [False, True])
def test_launch_saves_anywhere_by_default_and_inside_its_roots_when_given(procs, tmp_path, confine):
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    ckpt, other = tmp_path / "runs" / "ckpt", tmp_path / "other"
    cmd = [*ZMQFLOW, "launch", "--workers", "1", "--ps", "1"]
    if confine:
        cmd += ["--checkpoint-root", str(tmp_path / "runs")]
    p = procs([*cmd, "--", sys.executable, str(script), str(ckpt), str(other)])
    assert p.wait(90) == 0, p.output
    assert "trained" in p.output and checkpoint.latest(str(ckpt)) is not None  # the script's checkpoint_dir
    said = f"checkpoint roots: {(tmp_path / 'runs').resolve()}" if confine else "checkpoint roots: anywhere"
    assert said in p.output, p.output
    if confine:
        assert "refused:" in p.output and "outside this task's checkpoint roots" in p.output, p.output
        assert not other.exists()
    else:
        assert "saved outside" in p.output and checkpoint.latest(str(other)) is not None, p.output


@pytest.mark.parametrize("swapped", ["run", "run/sub"])
def test_a_link_swapped_in_after_the_check_is_not_written_through(tmp_path, monkeypatch, swapped):
    """The directory is checked on names, then reached from its root one component at a time,
    no link followed: a link put in place of a checked directory between the two leads nowhere."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "run").mkdir(parents=True)
    outside.mkdir()
    spec = make_spec({"ps": 1, "worker": 1}, "tcp")
    with zf.Server(spec, "ps:0", checkpoint_roots=[str(root)]) as ps, zf.Server(spec, "worker:0") as worker, \
            zf.Session(worker.target) as sess:
        sess.variable("v", np.arange(4.0))
        roots = ps.async_server.service("ps").checkpoint_roots
        checked = roots.confine

        def then_swapped(directory: str) -> str:
            real = checked(directory)
            if not os.path.islink(root / "run"):
                os.rename(root / "run", root / "run.checked")
                os.symlink(outside, root / "run")
            return real

        monkeypatch.setattr(roots, "confine", then_swapped)
        with pytest.raises(errors.PermissionDenied, match="'run' on its way became a symbolic link"):
            sess.call("ps", "save", {"directory": str(root / swapped), "file": "x.safetensors"}, task="ps:0")
        assert tree(outside) == [] and tree(root / "run.checked") == []
        monkeypatch.undo()
        os.remove(root / "run")
        sess.call("ps", "save", {"directory": str(root / swapped), "file": "x.safetensors"}, task="ps:0")
        assert (root / swapped / "x.safetensors").is_file()


def test_a_checkpoint_whose_file_is_a_link_is_none_and_is_not_read(tmp_path):
    """A manifest's files are read only as files of its own directory: a link there, to a file
    anywhere, makes no checkpoint (never listed, kept or pruned as one) and is refused by name."""
    from zmqflow.state.store import ShardStore

    store = ShardStore()
    store.create("w", 0, [3], [0, 3], "float64", value=np.full(3, 1.0))
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    first = checkpoint.save_store(store, str(ckpt), 1, keep=0)
    second = checkpoint.save_store(store, str(ckpt), 2, keep=0)
    (shard,) = [s["file"] for s in json.loads(open(second).read())["shards"]]
    os.replace(ckpt / shard, outside / shard)
    os.symlink(outside / shard, ckpt / shard)
    assert checkpoint.checkpoints(str(ckpt)) == [first] and checkpoint.latest(str(ckpt)) == first
    with pytest.raises(errors.InvalidArgument, match=f"{shard}' is a symbolic link"):
        checkpoint.restore_store(second)
    checkpoint.save_store(store, str(ckpt), 3, keep=1)
    assert (outside / shard).is_file()
