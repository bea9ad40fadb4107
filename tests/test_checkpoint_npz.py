"""Format-1 (``.npz``) shard files: each array's ``.npy`` header is checked before anything it
claims is allocated, and ``inspect`` reads headers only."""

from __future__ import annotations

import json
import tracemalloc
import zipfile
from pathlib import Path

import pytest
from numpy.lib import format as npy

from zmqflow import checkpoint
from zmqflow.cli.checkpoint import inspect_path
from zmqflow.errors import InvalidArgument

FILE = "step0000000001-1-ab-replica.npz"


def _write(directory: Path, shape: tuple[int, ...], data_bytes: int) -> Path:
    """A format-1 checkpoint of one float64 variable ``v`` whose member declares ``shape`` and
    holds ``data_bytes`` bytes of zeros, deflated."""
    with zipfile.ZipFile(directory / FILE, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("p0.value.npy", "w", force_zip64=True) as fh:
            npy.write_array_header_1_0(fh, {"descr": "<f8", "fortran_order": False, "shape": shape})
            chunk = bytes(1 << 20)
            while data_bytes > 0:
                fh.write(chunk[: min(data_bytes, len(chunk))])
                data_bytes -= len(chunk)
    record = {"name": "v", "shape": list(shape), "dtype": "float64", "optimizer": None, "table": None,
              "parts": [{"task": "local", "rows": [0, shape[0]]}]}
    manifest = {"format": 1, "step": 1, "records": [record], "shards": [{"task": "local", "file": FILE, "entries": [
        {"kind": "part", "name": "v", "part": 0, "key": "p0", "rows": [0, shape[0]]}]}]}
    (directory / "checkpoint-0000000001.json").write_text(json.dumps(manifest))
    return directory / FILE


@pytest.mark.parametrize("shape, data_bytes, message", [
    ((1 << 40,), 0, r"'p0.value' declares 8796093022208 bytes, over the"),
    ((1000,), 80, r"'p0.value' declares \[1000\] of float64 \(8000 bytes\), but its member holds 80"),
], ids=["8 TiB declared", "more declared than held"])
def test_an_array_whose_header_claims_what_its_member_does_not_hold_is_refused(tmp_path, shape, data_bytes, message):
    path = _write(tmp_path, shape, data_bytes)
    for read in (inspect_path, checkpoint.restore_store):
        with pytest.raises(InvalidArgument, match=message) as refused:
            read(str(tmp_path))
        assert refused.value.details["file"] == str(path)


def test_inspect_reads_an_npz_files_headers_only(tmp_path):
    n = (64 << 20) // 8  # 64 MiB of zeros: a few hundred KiB deflated
    _write(tmp_path, (n,), n * 8)
    tracemalloc.start()
    try:
        info = inspect_path(str(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info["checkpoint"]["variables"][0]["shape"] == [n]
    assert info["checkpoint"]["variables"][0]["bytes"] == n * 8
    assert peak < 8 << 20, f"inspect allocated {peak} bytes"
    step, saved = checkpoint.restore_store(str(tmp_path))  # a restore reads it, whole
    assert step == 1 and saved["v"]["value"].shape == (n,) and not saved["v"]["value"].any()
