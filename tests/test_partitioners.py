"""Partitioners: how a variable's rows split into parts, as TF's partitioners split them."""

from __future__ import annotations


import numpy as np
import pytest

from zmqflow.errors import InvalidArgument
from zmqflow.state.partition import (Partitioner, fixed_size_partitioner, min_max_variable_partitioner, num_partitions,
                                     row_splits)

F32, F64 = np.dtype("float32"), np.dtype("float64")


def test_fixed_size_partitioner_tf_splits():
    p = fixed_size_partitioner(3)
    assert p.count((10, 4), F32) == 3
    assert p((10, 4), F32) == [3, 1]
    assert row_splits(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert row_splits(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert row_splits(5, 1) == [(0, 5)]


def test_never_more_parts_than_rows():
    assert fixed_size_partitioner(5).count((2, 8), F32) == 2
    assert fixed_size_partitioner(5)((2, 8), F32) == [2, 1]
    assert fixed_size_partitioner(4).count((), F32) == 1
    assert fixed_size_partitioner(4)((), F32) == []
    # 1 byte minimum slices want one row per part: capped by the rows, then by max_partitions
    assert min_max_variable_partitioner(1000, min_slice_size=1).count((100, 1), F32) == 100
    assert min_max_variable_partitioner(7, min_slice_size=1).count((100, 1), F32) == 7
    assert num_partitions(50, (3, 2), F32) == 3


@pytest.mark.parametrize(
    "shape, dtype, max_partitions, min_slice_size, expected",
    [
        # 256 bytes a row; 64 KiB slices hold 256 rows; ceil(1000 / 256) = 4
        ((1000, 64), F32, 8, 64 << 10, 4),
        ((1000, 64), F32, 2, 64 << 10, 2),
        ((1024, 64), F32, 8, 64 << 10, 4),
        ((1025, 64), F32, 8, 64 << 10, 5),
        # 512 bytes a row: 128 rows a slice, ceil(1000 / 128) = 8
        ((1000, 64), F64, 16, 64 << 10, 8),
        ((1000, 64), F64, 8, 64 << 10, 8),
        ((1000, 64), F64, 3, 64 << 10, 3),
        # tiny: one part whatever the cap
        ((10, 4), F32, 8, 256 << 10, 1),
        # a row bigger than the slice: one row per part
        ((6, 100_000), F32, 10, 256 << 10, 6),
        # 1-D: 4 bytes a row, 256 KiB = 65536 rows a slice
        ((200_000,), F32, 8, 256 << 10, 4),
    ],
)
def test_min_max_variable_partitioner(shape, dtype, max_partitions, min_slice_size, expected):
    p = min_max_variable_partitioner(max_partitions=max_partitions, min_slice_size=min_slice_size)
    assert p.count(shape, dtype) == expected
    assert num_partitions(p, shape, dtype) == expected
    assert p(shape, dtype) == [expected] + [1] * (len(shape) - 1)


def test_min_max_default_is_one_part():
    assert min_max_variable_partitioner().count((100_000, 100), F32) == 1


@pytest.mark.parametrize("dim, n", [(10, 3), (7, 7), (1, 1), (100, 8), (13, 5), (0, 1)])
def test_row_splits_cover_contiguously(dim, n):
    splits = row_splits(dim, n)
    assert len(splits) == n
    assert splits[0][0] == 0 and splits[-1][1] == dim
    assert all(a[1] == b[0] for a, b in zip(splits, splits[1:]))
    sizes = [b - a for a, b in splits]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert sum(1 for s in sizes if s > dim // n) == dim % n


def test_num_partitions_inputs():
    assert num_partitions(None, (10, 2), F32) == 1
    assert num_partitions(4, (10, 2), F32) == 4
    assert num_partitions(4, (), F32) == 1
    assert num_partitions(0, (10, 2), F32) == 1
    assert num_partitions(lambda shape, dtype: [5, 1], (10, 2), F32) == 5
    assert num_partitions(fixed_size_partitioner(3), (10, 2), F32) == 3
    with pytest.raises(InvalidArgument, match="axis 0"):
        num_partitions(lambda shape, dtype: [1, 2], (10, 2), F32)
    with pytest.raises(InvalidArgument):
        num_partitions(lambda shape, dtype: [2], (10, 2), F32)
    with pytest.raises(InvalidArgument, match="str"):
        num_partitions("3", (10, 2), F32)
    with pytest.raises(InvalidArgument):
        num_partitions(True, (10, 2), F32)


def test_bad_partitioner_arguments():
    for bad in (
        lambda: fixed_size_partitioner(0),
        lambda: fixed_size_partitioner(2, axis=1),
        lambda: min_max_variable_partitioner(0),
        lambda: min_max_variable_partitioner(2, min_slice_size=0),
        lambda: min_max_variable_partitioner(2, axis=1),
    ):
        with pytest.raises(InvalidArgument):
            bad()
    assert isinstance(fixed_size_partitioner(2), Partitioner)
