"""The compiled parts: the hash index's inner loops (zmqflow/state/hash_probe.c), the
optimizers' one-pass updates, of one part or many, the pull's streaming copy and the sum of a
sparse gradient's rows per id (zmqflow/state/kernels_c.c, kernels_many.c, kernels_rows.c), the
ring's one-pass fold (zmqflow/state/fold_c.c), and the codec's common case (zmqflow/wire/codec_c.c).

All are optional: where no C compiler is found the build goes on without them, the index runs
its numpy rounds (``zmqflow.state.hash_index.compiled()`` tells which), the kernels numpy's
way (``zmqflow.state.kernels.compiled()``) and the codec in Python (``zmqflow.wire.codec.compiled()``). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

_COMMON = ["zmqflow/state/kernels_common.h"]
# no contraction: a fused multiply-add would round once where numpy's two steps round twice;
# no errno from sqrt (its arguments are never negative) lets the compiler vectorise it
_EXACT = ["-O3", "-ffp-contract=off", "-fno-math-errno"]

setup(ext_modules=[
    Extension("zmqflow.state.hash_probe", ["zmqflow/state/hash_probe.c"], optional=True, extra_compile_args=["-O3"]),
    Extension("zmqflow.state.kernels_c", ["zmqflow/state/kernels_c.c", "zmqflow/state/kernels_many.c",
                                          "zmqflow/state/kernels_rows.c"], optional=True,
              depends=[*_COMMON, "zmqflow/state/kernels_c.h"],
              extra_compile_args=_EXACT),
    Extension("zmqflow.state.fold_c", ["zmqflow/state/fold_c.c"], optional=True, depends=_COMMON,
              extra_compile_args=_EXACT),
    Extension("zmqflow.wire.codec_c", [f"zmqflow/wire/codec_{part}.c" for part in ("c", "write", "read", "batch")], optional=True,
              depends=["zmqflow/wire/codec_c.h"], extra_compile_args=["-O2"]),
    Extension("zmqflow.transport.zsock_c", ["zmqflow/transport/zsock_c.c", "zmqflow/transport/zsock_buffers.c"], optional=True,
              depends=["zmqflow/transport/zsock_c.h"], extra_compile_args=["-O2"]),
])
