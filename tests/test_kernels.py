"""The C loops of zmqflow/state/kernels_c.c (the optimizers' one-pass updates, the pull's streaming copy):
built where they can be, with numpy's results, strict about the arrays they are handed, and
skipped by their wrappers (zmqflow/state/kernels.py) where they do not apply."""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig
from collections.abc import Iterator

import numpy as np
import pytest

from zmqflow.state import kernels as wrappers
from zmqflow.state.optim import SGD, Adagrad, Adam, Momentum
from zmqflow.state.store import ShardStore

kernels = wrappers._built
needs_kernels = pytest.mark.skipif(kernels is None, reason="zmqflow/state/kernels_c.c is not built here: numpy runs")


def test_the_fused_update_is_built_where_a_compiler_is() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = sysconfig.get_paths()["include"]
    if not shutil.which(cc) or not os.path.exists(f"{headers}/Python.h"):
        pytest.skip(f"no C compiler ({cc}) or Python headers here: the optimizers run numpy's steps")
    assert wrappers.compiled(), "zmqflow/state/kernels_c.c or fold_c.c was not built: run pip install -e . again"


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [1, 1000, 70_001])  # the last is past the size that releases the GIL
def test_axpy_has_numpys_bits(dtype: str, n: int) -> None:
    """y + float(a) * x rounded as numpy rounds its temporary, then the sum (no fused multiply-add)."""
    rng = np.random.default_rng(n)
    y, x = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    for a in (-0.037, 1e-3, -3.0e7):
        want = y + np.multiply(x, a, dtype=dtype)
        got = y.copy()
        kernels.axpy(got, x, a)
        assert got.tobytes() == want.tobytes()


@needs_kernels
def test_axpy_refuses_what_it_cannot_do_and_changes_nothing() -> None:
    y, x = np.ones(8, np.float32), np.ones(8, np.float32)
    cases = [
        (y, x.astype(np.float64), TypeError, "float32 arrays or float64 arrays, all alike; array 1 is 'd'"),
        (y.astype(np.float16), x.astype(np.float16), TypeError, "array 0 is 'e'"),
        (y, x[:7], ValueError, "array 0 holds 32 bytes and array 1 28"),
        (y, y, ValueError, "arrays 0 and 1 overlap"),
        (y[1:], y[:-1], ValueError, "overlap"),
        (y[::2], x[::2], (BufferError, ValueError), None),  # not contiguous
    ]
    for yy, xx, err, match in cases:
        before = yy.copy()
        with pytest.raises(err, match=match):
            kernels.axpy(yy, xx, 2.0)
        assert np.array_equal(yy, before)
    frozen = np.ones(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        kernels.axpy(frozen, x, 2.0)
    assert (frozen == 1).all()


def _reference_sgd(param: np.ndarray, grad: np.ndarray, lr: float) -> np.ndarray:
    """numpy's two steps: the scaled gradient made into an array of the parameter's dtype, subtracted."""
    scaled = np.empty(param.shape, param.dtype)
    np.multiply(grad, lr, out=scaled)
    return param - scaled


@pytest.mark.parametrize("case", ["strided", "mixed dtypes", "float16", "aliased", "2-D rows"])
def test_sgd_takes_every_layout_with_the_same_bits(case: str) -> None:
    """Arrays the C pass refuses go through numpy; the ones it takes give numpy's bits."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal((40, 6)).astype(np.float32)
    grad = rng.standard_normal((40, 6)).astype(np.float32)
    if case == "strided":
        param, grad = base[:, ::2], grad[:, ::2]
    elif case == "mixed dtypes":
        param, grad = base.astype(np.float64), grad
    elif case == "float16":
        param, grad = base.astype(np.float16), grad.astype(np.float16)
    elif case == "aliased":
        param, grad = base, base
    else:
        param = base[5:30]
        grad = grad[5:30]
    want = _reference_sgd(param.copy(), grad.copy(), 0.05)
    got = SGD(0.05).update(param, grad, {}, None)
    assert got is param
    assert got.tobytes() == want.tobytes()


def test_momentum_keeps_its_bits_with_the_fused_step() -> None:
    """Momentum's last step (param -= lr * velocity) is the fused one; against numpy spelled out."""
    rng = np.random.default_rng(11)
    for nesterov in (False, True):
        param, m = rng.standard_normal(500).astype(np.float32), np.zeros(500, np.float32)
        ref_p, ref_m = param.copy(), m.copy()
        for _ in range(4):
            g = rng.standard_normal(500).astype(np.float32)
            Momentum(0.1, 0.9, nesterov).update(param, g, {"momentum": m}, None)
            ref_m = ref_m * np.float32(0.9) + g
            step = (ref_m * np.float32(0.9) + g) if nesterov else ref_m
            ref_p = ref_p - step * np.float32(0.1)
        assert param.tobytes() == ref_p.tobytes()
        assert m.tobytes() == ref_m.tobytes()


@needs_kernels
@pytest.mark.parametrize("n", [0, 1, 63, 64, 1000, (1 << 20) + 77])
@pytest.mark.parametrize("shift", [0, 3])  # a destination off the 16-byte boundary the stores need
def test_the_streaming_copy_copies_every_byte(n: int, shift: int) -> None:
    rng = np.random.default_rng(n + shift)
    src = rng.integers(0, 256, n, dtype=np.uint8)
    store = np.zeros(n + 16, np.uint8)
    dst = store[shift:shift + n]
    kernels.copy(dst, src)
    assert dst.tobytes() == src.tobytes()
    assert not store[:shift].any() and not store[shift + n:].any()  # nothing written past either end


@needs_kernels
def test_the_streaming_copy_refuses_what_it_cannot_do_and_changes_nothing() -> None:
    src, dst = np.arange(16, dtype=np.float32), np.zeros(16, np.float32)
    with pytest.raises(ValueError, match="64 bytes and src 60"):
        kernels.copy(dst, src[:15])
    with pytest.raises(ValueError, match="overlap"):
        kernels.copy(src[1:], src[:-1])
    with pytest.raises((BufferError, ValueError)):
        kernels.copy(dst[::2], src[::2])
    frozen = np.zeros(16, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        kernels.copy(frozen, src)
    assert not dst.any() and not frozen.any()
    assert np.array_equal(src, np.arange(16, dtype=np.float32))


@pytest.mark.parametrize("case", ["big", "small", "strided", "other dtype", "broadcast", "2-D rows"])
def test_copy_into_copies_whatever_it_is_handed(case: str) -> None:
    """The wrapper streams what it can and hands the rest to numpy's assignment, same result."""
    n = wrappers.STREAM_FROM // 4 + 5
    src = np.arange(n, dtype=np.float32)
    dst = np.zeros(n, np.float32)
    if case == "small":
        src, dst = src[:100], dst[:100]
    elif case == "strided":
        src, dst = src[::2], dst[::2]
    elif case == "other dtype":
        dst = np.zeros(n, np.float64)
    elif case == "broadcast":
        src = np.float32(7.0)
    elif case == "2-D rows":
        src, dst = src[: (n // 8) * 8].reshape(-1, 8), np.zeros((n // 4, 8), np.float32)[3: 3 + n // 8]
    want = np.empty_like(dst)
    want[...] = src
    wrappers.copy_into(dst, src)
    assert dst.tobytes() == want.tobytes()


@pytest.mark.parametrize("case", ["scalar f32", "rows f64", "float16", "int64", "read-only", "strided"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_add_into_has_numpys_bits_or_leaves_the_work_to_numpy(case: str, sign: float) -> None:
    """A shard's ``assign_add``/``assign_sub``: one C call where it fits, numpy's bits; False
    with nothing changed where it does not (the caller then runs numpy's in-place add)."""
    rng = np.random.default_rng(7)
    dtype = {"rows f64": "float64", "float16": "float16", "int64": "int64"}.get(case, "float32")
    shape = () if case == "scalar f32" else (6, 5)
    y = np.asarray(rng.standard_normal(shape) * 100, dtype)  # 0-d arrays, not numpy scalars
    x = np.asarray(rng.standard_normal(shape) * 100, dtype)
    if case == "read-only":
        y.flags.writeable = False
    if case == "strided":
        y, x = np.zeros((12, 5), dtype)[::2], x
    want = y + x if sign > 0 else y - x
    before = y.copy()
    fits = kernels is not None and case in ("scalar f32", "rows f64")
    assert wrappers.add_into(y, x, sign) is fits
    assert y.tobytes() == (want if fits else before).tobytes()


@contextlib.contextmanager
def _numpy_only() -> Iterator[None]:
    before = wrappers.use_compiled(False)
    try:
        assert not wrappers.compiled()
        yield
    finally:
        wrappers.use_compiled(before)


@needs_kernels
@pytest.mark.parametrize("opt", [Momentum(0.05, 0.9), Momentum(0.05, 0.7, nesterov=True), Adagrad(0.05), Adam(0.01),
                                 Adam(0.2, 0.5, 0.7, 1e-3)], ids=["momentum", "nesterov", "adagrad", "adam", "adam-odd"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(1, 1), (37, 5), (70_000, 1)])
def test_one_pass_updates_have_numpys_bits(opt, dtype: str, shape: tuple[int, int]) -> None:
    """Several steps, rows at different step counts (Adam's per-row size): parameter and every
    slot equal, bit for bit, to numpy's chain of whole-array steps."""
    rng = np.random.default_rng(shape[0])
    init = rng.standard_normal(shape).astype(dtype)
    grads = [rng.standard_normal(shape).astype(dtype) for _ in range(4)]
    t0 = rng.integers(0, 50, shape[0])

    def run() -> list[bytes]:
        param = init.copy()
        slots = {k: np.full(shape, opt.slot_init(k), dtype) for k in opt.slot_names}
        t = t0.copy()
        for g in grads:
            t += 1
            assert opt.update(param, g, slots, t if opt.uses_step else None) is param
        return [param.tobytes(), *(s.tobytes() for s in slots.values())]

    fused = run()
    with _numpy_only():
        reference = run()
    assert fused == reference


@needs_kernels
@pytest.mark.parametrize("opt", [SGD(0.1), Momentum(0.1), Momentum(0.1, nesterov=True), Adagrad(0.1), Adam(0.01)],
                         ids=["sgd", "momentum", "nesterov", "adagrad", "adam"])
def test_a_shard_steps_the_same_with_and_without_the_c_updates(opt) -> None:
    """Through the store, dense row ranges and sparse rows with duplicates (fancy-indexed copies):
    the same values and slots either way."""
    rng = np.random.default_rng(3)
    init = rng.standard_normal((50, 8)).astype(np.float32)
    pushes = [(rng.standard_normal((20, 8)).astype(np.float32), rng.integers(0, 50, 12),
               rng.standard_normal((12, 8)).astype(np.float32)) for _ in range(3)]

    def run() -> list[bytes]:
        s = ShardStore()
        s.create("w", 0, [50, 8], [0, 50], "float32", optimizer=opt.spec())
        s.assign("w", 0, init)
        for dense, idx, rows in pushes:
            s.apply_dense("w", 0, dense, 10, 30)
            s.apply_sparse("w", 0, idx, rows)
        part = s.get("w", 0)
        return [part.value.tobytes(), *(v.tobytes() for v in part.slots.values())]

    fused = run()
    with _numpy_only():
        assert run() == fused


@needs_kernels
def test_the_one_pass_updates_refuse_what_they_cannot_do_and_change_nothing() -> None:
    p, g, m, v = (np.ones((4, 2), np.float32) for _ in range(4))
    lr = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        kernels.adam(p, g, p, v, 0.1, 0.9, 0.001, 0.999, 1e-8, lr)
    with pytest.raises(ValueError, match="8 elements do not make 3 rows"):
        kernels.adam(p, g, m, v, 0.1, 0.9, 0.001, 0.999, 1e-8, lr[:3])
    with pytest.raises(TypeError, match="lr_rows"):
        kernels.adam(p, g, m, v, 0.1, 0.9, 0.001, 0.999, 1e-8, lr.astype(np.float64))
    with pytest.raises(TypeError, match="array 2 is 'd'"):
        kernels.adagrad(p, g.astype(np.float64), m, 0.1)
    with pytest.raises(ValueError, match="arrays 0 and 1 overlap"):
        kernels.momentum(p, g, p, 0.1, 0.9, True)
    for a in (p, g, m, v):
        assert (a == 1).all()
    assert not wrappers.adam_step(p, g, m, v, 0.9, 0.999, 1e-8, lr[:3])  # the wrapper says no first
    assert not wrappers.adagrad_step(p, g, p, 0.1)
    assert not wrappers.adagrad_step(p[:, :1], g[:, :1], m[:, :1], 0.1)  # strided
    assert (p == 1).all() and (m == 1).all()


def misaligned(n: int, dtype: str, offset: int, value: float) -> np.ndarray:
    """A writable array ``offset`` bytes into its buffer, off its type's alignment, as a view
    into a received frame may be."""
    a = np.frombuffer(bytearray(n * np.dtype(dtype).itemsize + 8), dtype, n, offset)
    a[...] = value
    assert not a.flags.aligned and a.flags.writeable
    return a


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_c_loops_refuse_arrays_off_their_alignment(dtype: str) -> None:
    p, g, m, v = (misaligned(8, dtype, off, 1.0) for off in (1, 2, 3, 5))
    q, h, lr = np.ones(8, dtype), np.ones(8, dtype), np.ones(8, dtype)
    calls = [(kernels.axpy, (p, h, 0.5), "axpy: array 0"), (kernels.axpy, (q, g, 0.5), "axpy: array 1"),
             (kernels.momentum, (q, h, m, 0.1, 0.9, False), "momentum: array 1"),
             (kernels.adagrad, (q, h, v, 0.1), "adagrad: array 1"),
             (kernels.adam, (q, h, m, v, 0.1, 0.9, 0.001, 0.999, 1e-8, lr), "adam: array 1"),
             (kernels.adam, (q, h, np.ones(8, dtype), np.ones(8, dtype), 0.1, 0.9, 0.001, 0.999, 1e-8,
                             misaligned(8, dtype, 2, 1.0)), "lr_rows is not aligned")]
    for fn, args, match in calls:
        with pytest.raises(ValueError, match=match):
            fn(*args)
    for a in (p, g, m, v, q, h):
        assert (a == 1).all()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_arrays_off_their_alignment_are_stepped_by_numpy(dtype: str) -> None:
    """The wrappers leave them to numpy (False: nothing done), with numpy's result."""
    p, g, m, v = (misaligned(50, dtype, off, 0.5 + i) for i, off in enumerate((1, 2, 3, 5)))
    lr_rows = np.full(50, 0.1, dtype)
    assert not wrappers.momentum_step(p, g, m, 0.1, 0.9, False)
    assert not wrappers.adagrad_step(p, g, m, 0.1)
    assert not wrappers.adam_step(p, g, m, v, 0.9, 0.999, 1e-8, lr_rows)
    assert not wrappers.add_into(p, g, 1.0)
    assert not wrappers.fold_sum(np.empty(50, dtype), [g, m])
    for a, want in ((p, 0.5), (g, 1.5), (m, 2.5), (v, 3.5)):
        assert (a == want).all()
    want = p - np.multiply(g, 0.1, dtype=dtype)
    wrappers.sub_scaled(p, g, 0.1)
    assert p.tobytes() == want.tobytes()


def test_one_written_and_one_read_array_are_judged_as_by_the_general_rule() -> None:
    """The shortcut for one param and one gradient (a push's every variable) says what the rule
    for any number of arrays says: one dtype and shape, contiguous, aligned, the written one
    writeable, the two apart."""
    base = np.zeros(16, np.float32)
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    cases = {
        "apart": (np.zeros(8, np.float32), np.ones(8, np.float32), True),
        "read-only param": (frozen, np.ones(8, np.float32), False),
        "read-only gradient": (np.zeros(8, np.float32), frozen, True),
        "other dtype": (np.zeros(8, np.float64), np.ones(8, np.float32), False),
        "other shape": (np.zeros(8, np.float32), np.ones((8, 1), np.float32), False),
        "strided": (np.zeros(16, np.float32)[::2], np.ones(8, np.float32), False),
        "misaligned": (misaligned(8, "float32", 2, 0.0), np.ones(8, np.float32), False),
        "overlapping": (base[:8], base[4:12], False),
    }
    for name, (w, r, want) in cases.items():
        assert wrappers._takes([w], [r]) is want, name
        assert wrappers._takes([w], [r, r.copy()]) is want, name  # the general rule, a second read beside


@needs_kernels
@pytest.mark.parametrize("opt", [SGD(0.1), Momentum(0.05, 0.9), Adagrad(0.05), Adam(0.01)],
                         ids=["sgd", "momentum", "adagrad", "adam"])
def test_a_gradient_off_its_alignment_is_stepped_in_c_with_numpys_bits(opt) -> None:
    """A small gradient received over tcp lies off its type's alignment (as ZeroMQ's receive
    buffer placed it): the update still runs in C, on a copy, and leaves the gradient as it was."""
    rng = np.random.default_rng(11)
    init = rng.standard_normal((6, 5)).astype(np.float32)
    grad = misaligned(30, "float32", 2, 0.0).reshape(6, 5)
    grad[...] = rng.standard_normal((6, 5))
    sent = grad.copy()
    t = np.arange(1, 7)

    def run(g: np.ndarray) -> list[bytes]:
        param = init.copy()
        slots = {k: np.full(init.shape, opt.slot_init(k), np.float32) for k in opt.slot_names}
        assert opt.update(param, g, slots, t if opt.uses_step else None) is param
        return [param.tobytes(), *(s.tobytes() for s in slots.values())]

    ran: list[bool] = []
    real = wrappers._judged

    def judged(update, *args) -> bool:
        ran.append(real(update, *args))
        return ran[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wrappers, "_judged", judged)
        fused = run(grad)
    assert ran == [True]  # the C update took it
    with _numpy_only():
        assert run(sent) == fused
    assert np.array_equal(grad, sent) and not grad.flags.aligned
