"""The one compiled part: the hash index's inner loops (zmqflow/state/hash_probe.c).

Optional: where no C compiler is found the build goes on without it and the index runs its
numpy rounds (``zmqflow.state.hash_index.compiled()`` tells which). Everything else is in
pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("zmqflow.state.hash_probe", ["zmqflow/state/hash_probe.c"], optional=True,
                             extra_compile_args=["-O3"])])
