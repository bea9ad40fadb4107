"""The compiled parts: the hash index's inner loops (zmqflow/state/hash_probe.c) and the
optimizers' fused update (zmqflow/state/kernels.c).

Both are optional: where no C compiler is found the build goes on without them, the index runs
its numpy rounds (``zmqflow.state.hash_index.compiled()`` tells which) and the optimizers their
numpy steps (``zmqflow.state.optim.compiled()``). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("zmqflow.state.hash_probe", ["zmqflow/state/hash_probe.c"], optional=True, extra_compile_args=["-O3"]),
    # no contraction: a fused multiply-add would round once where numpy's two steps round twice
    Extension("zmqflow.state.kernels", ["zmqflow/state/kernels.c"], optional=True,
              extra_compile_args=["-O3", "-ffp-contract=off"]),
])
