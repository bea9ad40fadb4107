"""The hash index's C probe (zmqflow/state/hash_probe.c): built where it can be, and strict about the
arrays it is handed. That it answers as the numpy rounds and a dict do is tests/test_hash_index.py's
job (every test there runs on both)."""

from __future__ import annotations

import os
import shutil
import sysconfig

import numpy as np
import pytest

from zmqflow.state import hash_index


def test_the_c_probe_is_built_where_a_compiler_is() -> None:
    """``pip install`` compiles it (optional: without a compiler the numpy rounds run); where a C
    compiler and Python's headers are on the machine, a missing module means the build broke."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = sysconfig.get_paths()["include"]
    if not shutil.which(cc) or not os.path.exists(f"{headers}/Python.h"):
        pytest.skip(f"no C compiler ({cc}) or Python headers here: the index runs its numpy rounds")
    assert hash_index._compiled is not None, "zmqflow/state/hash_probe.c was not built: run pip install -e . again"


def test_the_c_probe_refuses_arrays_that_do_not_fit_the_index() -> None:
    """Checked before any memory is touched: a wrong size is a ValueError, never a stray read or write."""
    c = hash_index._compiled
    if c is None:
        pytest.skip("the C probe (zmqflow/state/hash_probe.c) is not built here")
    ctrl, handles = np.zeros(4, np.uint64), np.zeros(32, np.int32)
    keys, ids, out = np.zeros(8, np.int64), np.arange(3, dtype=np.int64), np.zeros(3, np.int64)
    c.find(ctrl, handles, keys, ids, out, None, 4)
    assert out.tolist() == [-1, -1, -1]
    for groups in (3, 5, 0, 1 << 33):
        with pytest.raises(ValueError, match=f"do not match {groups} groups"):
            c.find(ctrl, handles, keys, ids, out, None, groups)
    with pytest.raises(ValueError, match="one handle per control byte"):
        c.find(ctrl, handles[:16], keys, ids, out, None, 4)
    with pytest.raises(ValueError, match="out must hold 3 int64"):
        c.find(ctrl, handles, keys, ids, out[:2], None, 4)
    with pytest.raises(ValueError, match="int32 or int64"):
        c.find(ctrl, handles.view(np.int16), keys, ids, out, None, 4)
    with pytest.raises(TypeError):
        c.find(ctrl, handles, keys, ids, ids.astype(np.int64).tobytes(), None, 4)  # read-only out
    with pytest.raises(ValueError, match="handles_in must hold 3 int64"):
        c.place(ctrl, handles, ids, out[:1], 4)
    assert not ctrl.any() and not handles.any()
    full = np.full(4, 0x8181818181818181, np.uint64)  # every bucket taken: nothing can be placed
    with pytest.raises(RuntimeError, match="the index is full"):
        c.place(full, handles, ids, out, 4)
