"""Manifests edited or damaged by hand: one whose order is not a finite number is no checkpoint
(listing, saving and pruning go on without it); one whose shards, entries or records are not
what a reader takes from them is refused, naming the file and the field."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import zmqflow as zf
from zmqflow import checkpoint
from zmqflow.cli.checkpoint import inspect_path
from zmqflow.errors import InvalidArgument
from zmqflow.state.store import ShardStore

from .test_checkpoint import cluster


@pytest.mark.parametrize("seq", [math.inf, math.nan, 2.5])
def test_a_manifest_whose_seq_is_not_a_whole_number_is_no_checkpoint(tmp_path, seq):
    spec, servers, worker = cluster(1, tmp_path)
    directory = str(tmp_path / "ckpt")
    try:
        with zf.Session(worker.target) as sess:
            v = sess.variable("v", np.zeros(3))
            good = checkpoint.save(sess, directory, step=10)
            v.assign(np.ones(3))
            bad = Path(checkpoint.save(sess, directory, step=20))
            manifest = json.loads(bad.read_text())
            manifest["seq"] = seq
            bad.write_text(json.dumps(manifest))  # Infinity and NaN as JSON writes them
            assert checkpoint.latest(directory) == good
            assert checkpoint.restore(sess, directory) == 10
            later = checkpoint.save(sess, directory, step=30, keep=2)  # numbered and pruned without it
            assert checkpoint.checkpoints(directory) == [good, later]
    finally:
        for s in [worker, *servers]:
            s.stop()


def _replica(directory: Path) -> Path:
    store = ShardStore()
    store.create("w", 0, [3], [0, 3], "float64", value=np.arange(3.0))
    return Path(checkpoint.save_store(store, str(directory), 10))


def _entry(m: dict) -> dict:
    return m["shards"][0]["entries"][0]


SPOILED = {
    "a shard without entries": (lambda m: m["shards"][0].pop("entries"), "shards[0].entries"),
    "a shard that is a list": (lambda m: m["shards"].__setitem__(0, []), "shards[0]"),
    "an entry without a kind": (lambda m: _entry(m).pop("kind"), "shards[0].entries[0]"),
    "an entry whose part is text": (lambda m: _entry(m).update(part="0"), "shards[0].entries[0]"),
    "an entry whose rows are a number": (lambda m: _entry(m).update(rows=3), "shards[0].entries[0]"),
    "records that are a map": (lambda m: m.update(records={"w": 1}), "records"),
    "a record without a name": (lambda m: m["records"][0].pop("name"), "records[0]"),
}


@pytest.mark.parametrize("case", sorted(SPOILED))
def test_a_manifest_of_the_wrong_structure_is_refused_naming_the_file_and_field(tmp_path, case):
    spoil, where = SPOILED[case]
    path = _replica(tmp_path)
    manifest = json.loads(path.read_text())
    spoil(manifest)
    path.write_text(json.dumps(manifest))
    for read in (inspect_path, checkpoint.restore_store):
        with pytest.raises(InvalidArgument) as refused:
            read(str(path))
        assert refused.value.details == {"file": str(path), "field": where}
