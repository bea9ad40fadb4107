"""A save commits only a checkpoint that restores: a shard (or the catalog's shard) that restarted
without its state is refused before anything is committed or pruned."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import checkpoint
from zmqflow.errors import DeadlineExceeded, ShardStateLost

from .test_checkpoint import cluster


@pytest.mark.parametrize("lost", [0, 1], ids=["the catalog's shard", "another shard"])
def test_a_save_after_a_shard_restarted_empty_commits_and_prunes_nothing(tmp_path, lost):
    spec, servers, worker = cluster(2, tmp_path)
    directory = str(tmp_path / "ckpt")
    try:
        with zf.Session(worker.target) as sess:
            sess.variable("w", np.arange(8.0), partitioner=zf.fixed_size_partitioner(2))
            good = checkpoint.save(sess, directory, step=1, keep=1)
            before = sorted(os.listdir(directory))
            servers[lost].stop()
            servers[lost] = zf.Server(spec, f"ps:{lost}", checkpoint_roots=[str(tmp_path)])
            with pytest.raises(ShardStateLost, match="nothing was committed") as refused:
                checkpoint.save(sess, directory, step=2, keep=1)
            assert refused.value.task == f"ps:{lost}"
            assert checkpoint.checkpoints(directory) == [good]
            assert sorted(os.listdir(directory)) == before  # this save's shard files are gone too
            assert checkpoint.recover(sess, directory) == 1
            np.testing.assert_array_equal(sess.get("w").read(), np.arange(8.0))
    finally:
        for s in [worker, *servers]:
            s.stop()


def test_a_save_waits_for_the_directorys_lock_off_the_loop_and_no_longer_than_its_deadline(tmp_path):
    spec, servers, worker = cluster(1, tmp_path)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    holder = os.open(directory, os.O_RDONLY)  # another writer's lock: its own open file, so flock conflicts
    fcntl.flock(holder, fcntl.LOCK_EX)
    outcome: dict[str, BaseException | str] = {}

    def save() -> None:
        try:
            outcome["path"] = checkpoint.save(sess, str(directory), step=1, timeout=3)
        except BaseException as exc:  # noqa: BLE001 - looked at below
            outcome["error"] = exc

    try:
        with zf.Session(worker.target) as sess:
            sess.variable("w", np.zeros(3))
            saving = threading.Thread(target=save)
            saving.start()
            until = time.monotonic() + 30
            while not any(p.suffix == ".safetensors" for p in directory.iterdir()):  # the shard wrote its file
                assert time.monotonic() < until, "the shard never wrote its file"
                time.sleep(0.01)
            # the session answers while the save waits for the lock
            assert [v["name"] for v in sess.submit(sess.async_session.variables()).result(timeout=2)] == ["w"]
            saving.join(30)
            assert isinstance(outcome.get("error"), DeadlineExceeded), outcome
            assert outcome["error"].details["directory"] == str(directory)
            assert os.listdir(directory) == []  # nothing committed, the shard's file removed
            fcntl.flock(holder, fcntl.LOCK_UN)
            path = checkpoint.save(sess, str(directory), step=2)
            assert checkpoint.checkpoints(str(directory)) == [path]
    finally:
        os.close(holder)
        for s in [worker, *servers]:
            s.stop()
