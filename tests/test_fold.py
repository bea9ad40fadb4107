"""The ring's one-pass fold (``fold_c.fold``, wrapped by ``kernels.fold_sum``): numpy's bits
for every length, alignment and number of ranks, streamed or not (a NaN's sign and payload
excepted: NaN where numpy's is NaN), and a clear refusal of what it cannot take, changing
nothing."""

from __future__ import annotations

import numpy as np
import pytest

from zmqflow.state import kernels as wrappers

kernels = wrappers._built_fold
needs_kernels = pytest.mark.skipif(kernels is None, reason="zmqflow/state/fold_c.c is not built here: numpy folds")

SPECIAL = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-310, 3.4e38, -3.4e38]  # denormals of both types, overflow


def numpy_fold(views: list[np.ndarray], div: int) -> np.ndarray:
    """What ring_shm did before the C loop: one ufunc call per view, then the mean's division."""
    out = np.empty_like(views[0])
    np.add(views[0], views[1], out=out)
    for v in views[2:]:
        np.add(out, v, out=out)
    if div:
        out /= div
    return out


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit for bit, except inside a NaN: NaN exactly where ``want`` is, the sign and payload of
    each unspecified (fold_c.c)."""
    nan = np.isnan(want)
    return np.array_equal(np.isnan(got), nan) and got[~nan].tobytes() == want[~nan].tobytes()


def views_of(k: int, n: int, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    views = []
    for r in range(k):
        v = (rng.standard_normal(n) * 10.0 ** int(rng.integers(-3, 4))).astype(dtype)
        if n:
            idx = rng.integers(0, n, min(n, len(SPECIAL)))
            with np.errstate(over="ignore"):
                v[idx] = np.array(SPECIAL[: len(idx)]).astype(dtype)
        views.append(v)
    return views


@pytest.fixture(params=["avx", "sse2"])
def vectors(request):
    """Each test on both loops: the 32-byte one a CPU with AVX takes, and the 16-byte one of any x86-64."""
    if kernels is None:
        pytest.skip("zmqflow/state/fold_c.c is not built here: numpy folds")
    before = kernels._avx(request.param == "avx")
    yield request.param
    kernels._avx(before)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 7, 33, 1000, 70_001])  # the last is past the size that releases the GIL
@pytest.mark.parametrize("shift", [0, 1, 3])  # out off the 16- and 32-byte boundaries the vector stores need
@pytest.mark.parametrize("stream", [False, True])
def test_the_fold_has_numpys_bits(vectors, dtype: str, k: int, n: int, shift: int, stream: bool) -> None:
    views = views_of(k, n, dtype, seed=n * 31 + k)
    store = np.full(n + 8, 7, dtype)
    out = store[shift:shift + n]
    for div in (0, k):
        with np.errstate(all="ignore"):
            want = numpy_fold(views, div)
        kernels.fold(out, views, div, stream)
        assert same_bits(out, want), f"div={div}"
    assert (store[:shift] == 7).all() and (store[shift + n:] == 7).all()  # nothing written past either end


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nans_of_either_sign_fold_to_nan(vectors, dtype: str) -> None:
    """Where NaNs of opposite signs meet, which one an addition passes on is the compiler's
    choice (and numpy's): the result is NaN there, every other element numpy's bits."""
    n = 70
    views = [np.full(n, np.nan, dtype), np.full(n, -np.nan, dtype), np.arange(n, dtype=dtype)]
    views[0][::3], views[1][::3] = 1.5, -2.0
    out = np.empty(n, dtype)
    kernels.fold(out, views, 0, False)
    assert same_bits(out, numpy_fold(views, 0))
    assert np.isnan(out).sum() == n - len(range(0, n, 3))


@needs_kernels
def test_views_may_be_one_array_more_than_once() -> None:
    v = np.arange(100, dtype=np.float32)
    out = np.empty_like(v)
    kernels.fold(out, [v, v, v[::-1].copy(), v], 0, False)
    assert np.array_equal(out, v + v + v[::-1] + v)
    out[...] = 0
    assert wrappers.fold_sum(out, [v, v[:], v]) is True  # the wrapper takes them too: views are only read
    assert np.array_equal(out, v + v + v)


@needs_kernels
def test_the_fold_refuses_what_it_cannot_do_and_changes_nothing() -> None:
    a, b = np.arange(16, dtype=np.float32), np.ones(16, np.float32)
    out = np.zeros(16, np.float32)
    cases = [
        ((out, [a, b[:15]], 0, False), ValueError, "64 bytes and view 1 60"),
        ((out, [a, b.astype(np.float64)], 0, False), TypeError, "float32 arrays or float64 arrays"),
        ((out.astype(np.int32), [a.astype(np.int32), b.astype(np.int32)], 0, False), TypeError, "float32"),
        ((a, [a, b], 0, False), ValueError, "out and view 0 overlap"),
        ((a[1:], [a[:-1], b[1:]], 0, False), ValueError, "overlap"),
        ((out, [a], 0, False), ValueError, "2 to 64 views, got 1"),
        ((out, [a] * 65, 0, False), ValueError, "2 to 64 views, got 65"),
        ((out, [a, b], -1, False), ValueError, "div must be >= 0"),
        ((out, 5, 0, False), TypeError, "sequence of arrays"),
        ((out[::2], [a[::2], b[::2]], 0, False), (BufferError, ValueError), None),
        ((np.frombuffer(bytearray(65), np.float32, 16, 1), [a, b], 0, False), ValueError, "out is not aligned"),
        ((out, [a, np.frombuffer(bytearray(66), np.float32, 16, 2)], 0, False), ValueError, "view 1 is not aligned"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            kernels.fold(*args)
    frozen = np.zeros(16, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        kernels.fold(frozen, [a, b], 0, False)
    assert not out.any() and not frozen.any()
    assert np.array_equal(a, np.arange(16, dtype=np.float32)) and (b == 1).all()


@pytest.mark.parametrize("case", ["float16", "int32", "strided", "unaligned", "mixed", "overlapping", "one view",
                                  "turned off"])
def test_fold_sum_leaves_what_it_cannot_take_to_numpy(case: str) -> None:
    a, b = np.arange(8, dtype=np.float32), np.ones(8, np.float32)
    out = np.zeros(8, np.float32)
    views = [a, b]
    before = wrappers.compiled()
    if case == "float16":
        out, views = out.astype(np.float16), [a.astype(np.float16), b.astype(np.float16)]
    elif case == "int32":
        out, views = out.astype(np.int32), [a.astype(np.int32), b.astype(np.int32)]
    elif case == "strided":
        out, views = np.zeros(16, np.float32)[::2], [a, b]
    elif case == "unaligned":  # a float32 view one byte into its buffer
        views = [a, np.frombuffer(bytearray(33), np.float32, 8, 1)]
        assert not views[1].flags.aligned
    elif case == "mixed":
        views = [a, b.astype(np.float64)]
    elif case == "overlapping":
        out = a
    elif case == "one view":
        views = [a]
    else:
        wrappers.use_compiled(False)
    try:
        snapshot = out.copy()
        assert wrappers.fold_sum(out, views) is False
        assert np.array_equal(out, snapshot)  # nothing done: the caller folds with numpy
    finally:
        wrappers.use_compiled(before)


@needs_kernels
def test_fold_sum_divides_for_a_mean_and_streams_when_asked() -> None:
    views = views_of(3, (1 << 20) + 5, "float32", seed=5)
    for stream in (False, True):
        out = np.empty_like(views[0])
        assert wrappers.fold_sum(out, views, 3, stream) is True
        with np.errstate(all="ignore"):
            assert same_bits(out, numpy_fold(views, 3))
