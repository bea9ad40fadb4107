"""The compiled parts: the hash index's inner loops (zmqflow/state/hash_probe.c), and the
optimizers' one-pass updates and the pull's streaming copy (zmqflow/state/kernels_c.c).

Both are optional: where no C compiler is found the build goes on without them, the index runs
its numpy rounds (``zmqflow.state.hash_index.compiled()`` tells which) and the kernels numpy's
way (``zmqflow.state.kernels.compiled()``). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("zmqflow.state.hash_probe", ["zmqflow/state/hash_probe.c"], optional=True, extra_compile_args=["-O3"]),
    # no contraction: a fused multiply-add would round once where numpy's two steps round twice;
    # no errno from sqrt (its arguments are never negative) lets the compiler vectorise it
    Extension("zmqflow.state.kernels_c", ["zmqflow/state/kernels_c.c"], optional=True,
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"]),
])
